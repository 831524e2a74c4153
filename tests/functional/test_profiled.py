"""The public ops name themselves in ``torch.profiler`` traces (issue 30): ``attnopt::<op>`` ranges."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

import attnopt
import attnopt.functional as F

OPS = {
    "doubly_normalized_attention": lambda q, k, v: F.doubly_normalized_attention(q, k, v),
    "hybrid_normalized_attention": lambda q, k, v: F.hybrid_normalized_attention(q, k, v, torch.tensor(0.5)),
    "generalized_attention": lambda q, k, v: F.generalized_attention(q, k, v),
    "regularized_attention": lambda q, k, v: F.regularized_attention(q, k, v, regularizer=F.Tsallis(1.5)),
    "sparsemax": lambda q, k, v: F.sparsemax(q @ k.transpose(-2, -1)) @ v,
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_public_op_is_a_profiler_range(name: str) -> None:
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with profile() as prof:
        OPS[name](q, k, v).sum().backward()
    keys = {e.key for e in prof.key_averages()}
    assert f"attnopt::{name}" in keys


def test_no_range_without_a_profiler_and_signature_kept() -> None:
    """Outside a profiler the wrapper is transparent: same values, the op's own signature."""
    import inspect

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    torch.testing.assert_close(F.doubly_normalized_attention(q, k, v),
                               F.doubly_normalized_attention.__wrapped__(q, k, v))  # type: ignore[attr-defined]
    assert "iterations" in inspect.signature(attnopt.doubly_normalized_attention).parameters
