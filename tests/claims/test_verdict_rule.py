"""The one verdict rule of the trained claims (attnopt.claims._verdict) on synthetic arm results."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from attnopt.claims._verdict import (
    Judgement,
    combine,
    effect_of,
    judge_effect,
    paired_diffs,
    runs_needed,
    sanity_gate,
    training_record,
)


def _recs(arm_values: dict[str, list[float]], metric: str = "accuracy") -> list[dict]:
    return [
        {"arm": arm, "seed": i, "metrics": {metric: v}}
        for arm, vs in arm_values.items()
        for i, v in enumerate(vs)
    ]


def _passing_gate():  # noqa: ANN202
    return sanity_gate({"a": 90.0, "b": 80.0}, name="logistic regression", value=70.0, margin=1.0,
                       chance=10.0)


def test_effect_ci_is_student_t():
    xs = [1.0, 2.0, 4.0]
    e = effect_of(xs)
    sd = stats.tstd(xs)
    assert e.mean == pytest.approx(7 / 3)
    assert e.half == pytest.approx(stats.t.ppf(0.975, 2) * sd / math.sqrt(3))
    assert e.ci == pytest.approx((e.mean - e.half, e.mean + e.half))


def test_paired_diffs_pair_by_seed_and_sign():
    recs = _recs({"dnas": [0.9, 0.8, 0.7], "lnas": [0.5, 0.6]})
    assert paired_diffs(recs, "dnas", "lnas", "accuracy") == pytest.approx([0.4, 0.2])
    assert paired_diffs(recs, "dnas", "lnas", "accuracy", higher=False) == pytest.approx([-0.4, -0.2])


def test_reproduced_when_the_ci_lies_above_zero():
    j = judge_effect(effect_of([1.0, 1.2, 0.9, 1.1], paper=0.5), gate=_passing_gate())
    assert j.verdict == "reproduced"
    assert "above 0" in j.reason


def test_wrong_sign_beyond_the_ci_is_not_reproduced_never_partially():
    j = judge_effect(effect_of([-1.0, -1.2, -0.9], paper=0.5), gate=_passing_gate())
    assert j.verdict == "not reproduced"
    assert "opposite sign" in j.reason


def test_ci_excluding_the_papers_effect_is_not_reproduced():
    # mean 0, CI about ± 0.12, paper effect 3: the CI excludes it
    j = judge_effect(effect_of([0.1, -0.1, 0.05, -0.05], paper=3.0), gate=_passing_gate())
    assert j.verdict == "not reproduced"
    assert "excludes the paper's effect" in j.reason


def test_direction_only_claims_identical_runs_are_not_reproduced():
    j = judge_effect(effect_of([0.0, 0.0, 0.0]), gate=_passing_gate())
    assert j.verdict == "not reproduced" and "every effect in the paper's direction" in j.reason
    assert judge_effect(effect_of([0.1, -0.1, 0.05])).verdict == "inconclusive"


def test_underpowered_is_inconclusive_and_says_the_runs_needed():
    diffs = [2.0, -1.5, 1.0]  # CI ± ~4.3 straddles 0 and the paper's 0.56
    e = effect_of(diffs, paper=0.56)
    j = judge_effect(e, gate=_passing_gate(), unit="points")
    assert j.verdict == "inconclusive"
    assert j.reason.startswith("underpowered: CI ±")
    n = int(j.reason.rsplit("about n = ", 1)[1].split()[0])
    sd = stats.tstd(diffs)
    assert stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) < 0.28
    assert stats.t.ppf(0.975, n - 2) * sd / math.sqrt(n - 1) >= 0.28
    assert n == runs_needed(sd, 0.28)


def test_one_run_has_no_ci_and_is_inconclusive():
    e = effect_of([5.0], paper=0.5)
    assert e.half is None and e.ci is None
    assert judge_effect(e, gate=_passing_gate()).verdict == "inconclusive"
    assert judge_effect(effect_of([]), gate=_passing_gate()).verdict == "inconclusive"


def test_a_failed_gate_makes_even_a_clear_effect_inconclusive():
    gate = sanity_gate({"vit": 0.55, "ot-vit": 0.50}, name="logistic regression", value=0.97, margin=0.01)
    assert not gate.passed
    j = judge_effect(effect_of([1.0, 1.1, 1.2], paper=0.5), gate=gate)
    assert j.verdict == "inconclusive"
    assert j.reason == ("undertrained: best arm vit 0.55 vs logistic regression 0.97; a lead of more than "
                        "0.01 needed (the stated margin 0.01)")


def test_gate_at_chance_fails_even_when_the_baseline_need_not_be_beaten():
    gate = sanity_gate({"a": 10.2}, name="ridge", value=50.0, chance=10.0, margin=1.0, required=False)
    assert not gate.passed and "at chance" in gate.reason
    ok = sanity_gate({"a": 40.0}, name="ridge", value=50.0, chance=10.0, margin=1.0, required=False)
    assert ok.passed


def test_gate_lower_is_better():
    beat = sanity_gate({"a": 0.30, "b": 0.45}, name="ridge", value=0.35, higher=False, margin=0.01)
    assert beat.passed and beat.best_arm == "a"
    lose = sanity_gate({"a": 0.40}, name="ridge", value=0.35, higher=False, margin=0.01)
    assert not lose.passed


def test_gate_needs_a_lead_beyond_the_best_arms_noise():
    # a 2-point lead passes a 1-point margin, but not when the arm's own CI is ± 3 points
    quiet = sanity_gate({"a": 72.0}, name="logistic regression", value=70.0, margin=1.0, noise={"a": 0.5})
    noisy = sanity_gate({"a": 72.0}, name="logistic regression", value=70.0, margin=1.0, noise={"a": 3.0})
    assert quiet.passed and quiet.needed == 1.0
    assert not noisy.passed and noisy.needed == 3.0
    assert "95 % CI ± 3" in noisy.reason
    # the noise is the best arm's; another arm's noise and a non-finite one are ignored
    other = sanity_gate({"a": 72.0, "b": 60.0}, name="lr", value=70.0, margin=1.0, noise={"b": 9.0})
    assert other.passed and other.noise == 0.0
    nan = sanity_gate({"a": 72.0}, name="lr", value=70.0, margin=1.0, noise={"a": math.nan})
    assert nan.passed
    # lower is better, and chance needs the same lead
    low = sanity_gate({"a": 0.30}, name="ridge", value=0.35, higher=False, margin=0.01, noise={"a": 0.06})
    assert not low.passed
    ch = sanity_gate({"a": 12.0}, name="ridge", value=50.0, chance=10.0, margin=1.0, required=False,
                     noise={"a": 2.5})
    assert ch.at_chance and not ch.passed


def test_combine_partially_only_with_some_part_reproduced():
    r, n, i = (Judgement("reproduced", "x"), Judgement("not reproduced", "y"), Judgement("inconclusive", "z"))
    assert combine({"a": r, "b": r}).verdict == "reproduced"
    assert combine({"a": r, "b": i}).verdict == "partially reproduced"
    assert combine({"a": n, "b": i}).verdict == "not reproduced"
    assert combine({"a": r, "b": n}).verdict == "partially reproduced"
    assert combine({"a": i, "b": i}).verdict == "inconclusive"
    assert combine({"a": n}).verdict == "not reproduced"
    p = Judgement("partially reproduced", "w")
    assert combine({"a": p, "b": i}).verdict == "partially reproduced"


def test_non_finite_differences_raise():
    with pytest.raises(ValueError, match="finite"):
        effect_of([1.0, math.nan])
    with pytest.raises(ValueError, match="paper"):
        effect_of([1.0, 2.0], paper=-0.5)


def test_training_record_fields():
    gate = _passing_gate()
    rec = training_record(metric="accuracy", higher_is_better=True, arms={"a": [1.0, 2.0], "b": [3.0]},
                          gate=gate, effect=effect_of([1.0, 2.0], paper=0.5))
    assert rec["arms"]["a"]["n"] == 2 and rec["arms"]["b"]["ci95"] is None
    assert rec["baseline"] == {"name": "logistic regression", "value": 70.0, "passed": True, "margin": 1.0}
    assert rec["effect"]["paper"] == 0.5 and rec["effect"]["measured"] == pytest.approx(1.5)
