"""Quick claims of doubly-normalized-attention run and reproduce with the expected numbers."""
from pathlib import Path

import pytest

import attnopt.claims.doubly_normalized  # noqa: F401  (registers the claims; no other claim module)
from attnopt.claims import ClaimContext
from attnopt.claims._registry import _REGISTRY


@pytest.fixture(scope="module")
def claims():
    # the analytic claims of this module (the training claims register under the same paper when
    # another test imports attnopt.claims.doubly_normalized_training in this process)
    return {c.key: c for c in _REGISTRY.values()
            if c.paper == "doubly_normalized" and c.func.__module__ == "attnopt.claims.doubly_normalized"}


def test_all_five_claims_registered(claims):
    assert set(claims) == {"eq4_eq8", "eq10_sinkhorn", "lemma1", "eq11_12_fig2", "fig5_6"}


@pytest.mark.parametrize("key", ["eq4_eq8", "eq11_12_fig2"])
def test_quick_claim_reproduces(claims, key, tmp_path: Path):
    ctx = ClaimContext(quick=True, out_dir=tmp_path, prefix=key)
    res = claims[key].func(ctx)
    assert res.verdict == "reproduced", res.summary
    if key == "eq11_12_fig2":
        assert res.figures["max_rel_err_sim"] < 1e-9
        assert ctx.images and ctx.images[0].exists()
