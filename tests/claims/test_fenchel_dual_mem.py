"""The MEM claims of fenchel_dual (Thm 1, eq. 13/14, Sec. 5, Fig. 3) run in quick mode."""
from __future__ import annotations

import pytest

from attnopt.claims import ClaimContext
from attnopt.claims.fenchel_dual import mem as mem_claims


@pytest.fixture()
def ctx(tmp_path):
    return ClaimContext(quick=True, out_dir=tmp_path, prefix="t")


def test_theorem1(ctx):
    res = mem_claims.theorem1(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["max_abs_p_diff"] < 1e-8 and res.figures["max_duality_gap"] < 1e-9


def test_approximation_orders(ctx):
    res = mem_claims.approximation_orders(ctx)
    assert res.verdict == "reproduced"
    assert 1.8 < res.figures["slope_eq14"] < 2.2 and 2.7 < res.figures["slope_eq13"] < 3.3
    assert len(ctx.images) == 1 and ctx.images[0].exists()


def test_gaussian(ctx):
    res = mem_claims.gaussian_closed_form(ctx)
    assert res.verdict == "reproduced" and res.figures["max_h_err"] < 1e-6


def test_figure3(ctx):
    res = mem_claims.figure3(ctx)
    errs = [res.figures[f"mean_err_alpha_{a}"] for a in ("4", "2", "1", "0.5")]
    assert errs == sorted(errs, reverse=True) and errs[-1] > 0
    assert res.verdict == "reproduced"
    assert ctx.images[0].name.endswith("exact_vs_approx_h.png")
