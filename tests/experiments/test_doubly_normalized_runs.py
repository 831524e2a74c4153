"""Slow: the doubly-normalized tasks through the engine at quick scale (non-trivial results)."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_multiview_quick_is_non_trivial(tmp_path):
    from attnopt.experiments._engine import run_task

    recs = run_task("multiview-fusion", quick=True, out_dir=tmp_path, progress=False)
    assert {r["arm"] for r in recs} == {"single-view", "concat", "lnas", "dnas", "hnas"}
    assert all(r["metrics"]["accuracy"] > 60.0 for r in recs)  # chance is 10 %
    for r in recs:
        if r["arm"] == "dnas":
            assert all(h["min_column_mass_x_nk"] >= 1 - 1e-5 for h in r["history"])
        if r["arm"] == "hnas":
            assert all(0 < h["hnas_w/0"] < 1 for h in r["history"])


def test_text_tasks_quick_run(tmp_path):
    from attnopt.experiments._engine import run_task

    recs = run_task("headline", quick=True, seeds=[0], out_dir=tmp_path / "h", progress=False)
    assert all(math.isfinite(r["metrics"]["rougeL"]) and r["metrics"]["rougeL"] > 0 for r in recs)
    recs = run_task("pretrain-finetune", quick=True, seeds=[0], out_dir=tmp_path / "p", progress=False)
    for r in recs:
        m = r["metrics"]
        assert m["mlm_loss"] < math.log(5000) and 0 <= m["cls_accuracy"] <= 100
        assert {h["stage"] for h in r["history"]} == {"pretrain", "cls", "pair"}
