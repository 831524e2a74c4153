"""implicit_kernel claims run in quick mode and report what they measure."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.claims import ClaimContext
from attnopt.claims.implicit_kernel import approximation, complexity, identities, sparsity


@pytest.fixture()
def ctx(tmp_path):
    return ClaimContext(quick=True, out_dir=tmp_path, prefix="t")


def test_prop1_prop2_identities(ctx):
    r1 = identities.prop1(ctx)
    assert r1.verdict == "reproduced" and r1.figures["max_rel_error_identity"] < 1e-12
    r2 = identities.prop2(ctx)
    assert r2.verdict == "reproduced"
    assert 0 < r2.figures["negative_side_fraction"] < 1
    assert r2.figures["gatconv_max_abs_diff"] < 1e-10


def test_prop3_slope(ctx):
    res = approximation.prop3(ctx)
    assert res.verdict == "reproduced"
    assert -0.6 < res.figures["slope"] < -0.4
    assert len(ctx.images) == 1 and ctx.images[0].exists()


def test_prop4_bound(ctx):
    res = approximation.prop4(ctx)
    assert res.verdict == "reproduced", res.summary
    assert -0.65 < res.figures["slope"] < -0.35 and res.figures["bound_holds"] is True
    assert res.figures["sup_err_largest_R"] < res.figures["bound_largest_R"]
    assert ctx.images[0].exists()


def test_prop5_sparsity(ctx):
    res = sparsity.prop5(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["max_weight_p4"] < 0.5 < res.figures["max_weight_smallest_p"]
    assert res.figures["tie_rows"] > 0


def test_table1_complexity_is_deterministic(ctx, monkeypatch):
    res = complexity.table1(ctx)
    assert res.verdict == "reproduced", res.summary
    exponents = [v for k, v in res.figures.items() if k.startswith(("T_exp", "R_exp", "mem_exp"))]
    assert exponents and all(math.isfinite(v) for v in exponents)
    assert res.figures["T_exp_ikan linear mode"] < 1.1 < 1.5 < res.figures["T_exp_ikan"]

    def distorted_clock(fn, repeat):  # noqa: ARG001 - any wall time, as on a loaded machine
        return float(torch.rand(()) * 10)

    monkeypatch.setattr(complexity, "_wall", distorted_clock)
    again = complexity.table1(ctx)  # FLOPs and memory do not move with the machine's load
    assert again.verdict == res.verdict
    assert {k: v for k, v in again.figures.items() if not k.startswith("wall")} == {
        k: v for k, v in res.figures.items() if not k.startswith("wall")}
