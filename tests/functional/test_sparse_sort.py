"""The sort-based sparsemax / 1.5-entmax (the device path, :mod:`attnopt.functional.regularized.sort`)
equal the host searches (float64) exactly to rounding, with masks, ties and empty rows."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.functional.regularized.sort import entmax15_sort, sparsemax_sort

em = importlib.import_module("attnopt.functional.regularized.maps")  # the module


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
    z, empty = em._shift(x, dim)
    p, theta = (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, dim)
    ref = (em._sparsemax_forward(x, dim, 1000) if alpha == 2.0 else em._entmax15_forward(x, dim, 1e-12, 100))[
        0
    ]
    torch.testing.assert_close(p, ref, atol=1e-13, rtol=0)
    # the threshold reproduces p (θ feeds the backward's recomputation in _map_from_threshold)
    torch.testing.assert_close(em._map_from_threshold(x, theta, alpha, dim), ref, atol=1e-12, rtol=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 70), st.sampled_from([1.5, 2.0]))
def test_sort_equals_search_property(seed: int, n: int, alpha: float) -> None:
    x = _rows(seed, n)
    z, empty = em._shift(x, -1)
    p, _ = (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, -1)
    ref = (em._sparsemax_forward(x, -1, 1000) if alpha == 2.0 else em._entmax15_forward(x, -1, 1e-12, 100))[0]
    torch.testing.assert_close(p, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_meta_runs_the_sort_path(alpha: float) -> None:
    x = torch.empty(4, 7, device="meta", requires_grad=True)
    p = em.entmax(x, alpha)
    p.sum().backward()
    assert p.shape == x.shape and x.grad is not None and x.grad.shape == x.shape
