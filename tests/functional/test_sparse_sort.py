"""The sort-based sparsemax / 1.5-entmax (the reference, :mod:`attnopt.functional.regularized.sort`)
equal the float64 oracles of tests/reference and the C kernels exactly to rounding, with masks, ties
and empty rows."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.functional.regularized import cpu as _sparse_native
from attnopt.functional.regularized._common import map_from_threshold, shift
from attnopt.functional.regularized.sort import entmax15_sort, sparsemax_sort
from tests.reference.regularized import entmax15_sort as ref_entmax15_sort
from tests.reference.regularized import sparsemax_sort as ref_sparsemax_sort

em = importlib.import_module("attnopt.functional.regularized._maps")  # the module


def _oracle(x: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
    """The float64 oracle of tests/reference along ``dim``."""
    f = ref_sparsemax_sort if alpha == 2.0 else ref_entmax15_sort
    return f(x, dim=dim)


def _rows(seed: int, n: int = 33) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(6, n, generator=g, dtype=torch.float64)
        * torch.tensor([0.1, 1, 3, 10, 100, 1])[:, None].double()
    )
    x[5] = float("-inf")  # an empty row
    x[1, ::3] = float("-inf")  # masked entries
    x[2, :5] = x[2, 0]  # ties at the top
    return x


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("dim", [-1, 0])
def test_sort_equals_search(alpha: float, dim: int) -> None:
    x = _rows(0) if dim == -1 else _rows(0).T.contiguous()
    z, empty = shift(x, dim)
    p, theta = (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, dim)
    ref = _oracle(x, alpha, dim)
    torch.testing.assert_close(p, ref, atol=1e-13, rtol=0)
    # the threshold reproduces p (θ feeds the backward's recomputation in map_from_threshold)
    torch.testing.assert_close(map_from_threshold(x, theta, alpha, dim), ref, atol=1e-12, rtol=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 70), st.sampled_from([1.5, 2.0]))
def test_sort_equals_search_property(seed: int, n: int, alpha: float) -> None:
    x = _rows(seed, n)
    z, empty = shift(x, -1)
    p, _ = (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, -1)
    torch.testing.assert_close(p, _oracle(x, alpha, -1), atol=1e-12, rtol=0)
    if _sparse_native.library_available():  # the C kernel: the same thresholds
        pc, tc, redo = _sparse_native.forward(x, alpha, 1000)
        assert redo.numel() == 0
        torch.testing.assert_close(pc, p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_meta_runs_the_sort_path(alpha: float) -> None:
    x = torch.empty(4, 7, device="meta", requires_grad=True)
    p = em.entmax(x, alpha)
    p.sum().backward()
    assert p.shape == x.shape and x.grad is not None and x.grad.shape == x.shape
