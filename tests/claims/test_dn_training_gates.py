"""The sanity gates of the doubly-normalized Fig. 1 and Fig. 4 claims (synthetic records).

Fig. 4 (HNAS weight per layer) is gated by Table 3's downstream gates: weights of models that
learned nothing must not yield "not reproduced". Fig. 1 asks only that the arms are clear of
chance (a property of the attention, not a performance claim).
"""

from __future__ import annotations

from attnopt.claims import doubly_normalized_training as dn


def _pretrain(weights: list[float], *, acc: float, majority: float) -> list[dict]:
    recs = []
    for seed in range(3):
        for arm in ("lnas", "hnas"):
            m = {"cls_accuracy": acc + seed, "cls_majority": majority, "pair_accuracy": acc + seed,
                 "pair_majority": majority}
            if arm == "hnas":
                m |= {f"hnas_w/{i}": w for i, w in enumerate(weights)}
            recs.append({"arm": arm, "seed": seed, "metrics": m, "history": []})
    return recs


def test_fig4_of_untrained_models_is_inconclusive_not_a_contradiction():
    low = [0.40, 0.41, 0.42, 0.43]
    untrained = _pretrain(low, acc=49.0, majority=49.0)
    gate = dn.pretraining_gate(untrained)
    assert gate is not None and not gate.passed
    assert dn.judge_fig4(untrained, gate=gate).verdict == "inconclusive"
    trained = _pretrain(low, acc=80.0, majority=49.0)
    gate = dn.pretraining_gate(trained)
    assert gate is not None and gate.passed
    assert dn.judge_fig4(trained, gate=gate).verdict == "not reproduced"


def test_fig4_weight_outside_0_1_is_not_reproduced_whatever_the_gate():
    recs = _pretrain([1.5, 0.6, 0.6, 0.6], acc=49.0, majority=49.0)
    assert dn.judge_fig4(recs, gate=dn.pretraining_gate(recs)).verdict == "not reproduced"


def _fusion(lnas_min: list[float], acc: float) -> list[dict]:
    recs = []
    for seed, ln in enumerate(lnas_min):
        for arm, mins in (("lnas", ln), ("dnas", 2.5)):
            recs.append({"arm": arm, "seed": seed, "metrics": {"accuracy": acc + seed},
                         "history": [{"min_column_mass_x_nk": mins, "frac_explained_away": 0.2}]})
    return recs


def test_fig1_gate_asks_only_for_learning_clear_of_chance():
    below_lr = _fusion([0.01, 0.02, 0.0], acc=80.0)  # below logistic regression (88.9), far above chance
    assert dn.judge_fig1(below_lr, baseline=88.9).verdict == "reproduced"
    at_chance = _fusion([0.01, 0.02, 0.0], acc=10.0)
    assert dn.judge_fig1(at_chance, baseline=88.9).verdict == "inconclusive"
