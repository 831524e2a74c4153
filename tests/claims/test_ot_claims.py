"""The OT claims (fenchel_dual, Sec. 9 / App. D) run in quick mode and report what they measure."""
from __future__ import annotations

import pytest

from attnopt.claims import ClaimContext, all_claims
from attnopt.claims.fenchel_dual import ot as ot_claims


@pytest.fixture()
def ctx(tmp_path):
    return ClaimContext(quick=True, out_dir=tmp_path, prefix="t")


def test_prop1_true_preference(ctx):
    res = ot_claims.true_preference_minimizes(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["competitors_beating_u_tilde"] == 0 and res.figures["min_gap"] > 0
    assert res.figures["l1_err_smallest_gamma"] < 1e-6
    assert len(ctx.images) == 1 and ctx.images[0].exists()


def test_eq22_vs_exact(ctx):
    res = ot_claims.eq22_vs_exact(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["max_dev_small_ratio"] < 1e-3 < res.figures["max_dev_ratio_10"]
    assert 0.8 < res.figures["slope_min"] <= res.figures["slope_max"] < 1.2


def test_group_example(ctx):
    res = ot_claims.group_example(ctx)
    assert res.verdict == "reproduced"
    assert res.figures["max_dev_eps0"] < 1e-12 and res.figures["mass_on_non_inputs"] > 0.3


def test_reduction_limits(ctx):
    res = ot_claims.reduction(ctx)
    # beyond the paper's text: γ → 0 gives the hard OT assignment, γ → ∞ (α/γ fixed) eq. (16) with uniform u
    assert res.verdict == "reproduced"
    assert res.figures["rel_err_vs_hard_limit"] < 1e-8
    assert res.figures["rel_err_uniform_limit_largest_gamma"] < 1e-2
    assert res.figures["rel_err_vs_eq16_smallest_gamma"] > 0.1  # no reduction to (16) with u
    assert "beyond the paper" in res.summary.lower() and "eq. (37)" in res.summary
    (c,) = all_claims("fenchel_dual:ot_reduction")
    assert "issue" not in (c.reference + c.title + res.summary + res.details).lower()
