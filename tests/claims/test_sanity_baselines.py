"""The sanity baselines of the trained claims: scikit-learn / rule models on the claims' own splits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from attnopt.claims import ClaimContext
from attnopt.claims._sanity import BASELINES, baseline

pytest.importorskip("sklearn")


def _planned(task: str, module: str, tmp_path: Path) -> list[dict]:
    """Hand-made records (no metrics) of the runs a claim plans at quick scale, with their configs."""
    import importlib

    from attnopt.claims._training_common import planned_configs

    mod = importlib.import_module(f"attnopt.claims.{module}")
    ctx = ClaimContext(quick=True, out_dir=tmp_path)
    return [{"arm": c["arm"], "seed": c["seed"], "fold": c["fold"], "dataset": c["dataset"], "config": c,
             "metrics": {}} for c in planned_configs(ctx, task, mod._run_args)]


_FAST = [
    # task, claims module, (low, high): the baseline must learn (above chance / below the mean predictor)
    ("sentence-classification", "implicit_kernel.training", (0.5, 1.0)),  # majority class ~0.28
    ("regression", "implicit_kernel.training", (0.0, 0.8)),  # predicting the mean: RMSE ~1 (standardized)
    ("translation", "implicit_kernel.training", (0.0, 5.0)),  # copying German words is near-useless BLEU
]
_SLOW = [
    ("ot-vit", "fenchel_dual.ot_vit", (0.9, 1.0)),  # 10 digits: chance 0.1
    ("multiview-fusion", "doubly_normalized_training", (80.0, 100.0)),
    ("node-classification", "implicit_kernel.training", (0.3, 1.0)),
]


def _check(task: str, module: str, bounds: tuple[float, float], tmp_path: Path) -> None:
    recs = _planned(task, module, tmp_path)
    value = baseline(task, recs)
    lo, hi = bounds
    assert lo <= value <= hi, f"{task}: {BASELINES[task].name} gave {value}"
    # the same split gives the same number (deterministic, and served from the cache the second time)
    assert baseline(task, recs) == value


@pytest.mark.parametrize(("task", "module", "bounds"), _FAST, ids=[t[0] for t in _FAST])
def test_fast_baselines_learn_on_the_claims_split(task, module, bounds, tmp_path):
    _check(task, module, bounds, tmp_path)


@pytest.mark.slow  # 5-20 s each on a loaded 2-core machine; run with `pytest -m slow`
@pytest.mark.parametrize(("task", "module", "bounds"), _SLOW, ids=[t[0] for t in _SLOW])
def test_slow_baselines_learn_on_the_claims_split(task, module, bounds, tmp_path):
    _check(task, module, bounds, tmp_path)


def test_baselines_read_from_the_records_metrics():
    recs = [{"arm": "lnas-random", "metrics": {"copy_rougeL": 14.0}},
            {"arm": "hnas-random", "metrics": {"copy_rougeL": 16.0}}]
    assert baseline("headline", recs) == 15.0
    recs = [{"arm": "lnas", "metrics": {"cls_majority": 30.0, "pair_majority": 50.0}}]
    assert baseline("pretrain-finetune", recs, metric="pair_accuracy") == 50.0
    assert baseline("pretrain-finetune", recs) == 30.0
    assert math.isnan(baseline("ot-vit", [{"arm": "vit", "metrics": {}}]))  # no config: no split to rebuild
    with pytest.raises(KeyError, match="no sanity baseline"):
        baseline("nope", [])
