"""The C sparsemax / 1.5-entmax kernels and their PyTorch fallback: exact, same API, same errors."""
from __future__ import annotations

import importlib

import pytest
import torch

from attnopt.functional import entmax, sparsemax
from attnopt.functional.regularized import cpu as _sparse_native
from attnopt.functional.regularized._common import map_from_threshold
from tests._marks import needs_native
from tests.reference.regularized import entmax15_sort, sparsemax_sort

entmax_mod = importlib.import_module("attnopt.functional.regularized._maps")  # the module, not the function


@pytest.fixture
def path(native_or_torch):
    """Both sides: the C kernel and the PyTorch fallback (tests/functional/conftest.py)."""
    return native_or_torch


def _map(alpha):
    return sparsemax if alpha == 2.0 else (lambda t, **kw: entmax(t, 1.5, **kw))


def _ref(alpha):
    return sparsemax_sort if alpha == 2.0 else entmax15_sort


def _rows(n: int, dtype=torch.float64) -> torch.Tensor:
    """(20, n) rows: random at several scales plus the adversarial kinds."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(20, n, generator=g, dtype=torch.float64)
    x[0] *= 3.0
    x[1] *= 1e3  # huge scale: a one-entry support
    x[2] *= 1e-3  # tiny range: every entry in the support
    x[3] = 0.25  # all equal
    x[4] = float("-inf")  # fully masked
    x[5, n // 2 :] = float("-inf")  # masked tail
    x[6] = float("-inf")
    x[6, n // 3] = -7.0  # one finite entry
    x[7] += 1e3  # large offset
    x[8, : max(1, n // 4)] = 2.0  # ties at the max
    x[9, 1::2] = x[9, 0::2][: n // 2]  # every value twice
    x[10] = torch.linspace(0, 1, n, dtype=torch.float64) ** 8 * 3  # a long tail at the threshold
    x[11] = torch.where(torch.arange(n) % 3 == 0, 1.0, -1.0).double()  # two levels
    x[12, 0], x[12, 1:] = 1.0, 0.0  # ties exactly at the 1.5-entmax threshold (z = -2 <=> c)
    x[13, 0], x[13, 1:] = 0.5, -0.5  # ... and at the sparsemax threshold (z = -1)
    x[14:] *= torch.logspace(-1, 1, 6, dtype=torch.float64)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("n", [1, 3, 7, 33, 257, 1000])
def test_float64_equals_sort_reference(path, alpha, n):
    x = _rows(n)
    p = _map(alpha)(x)
    ref = _ref(alpha)(x)
    torch.testing.assert_close(p, ref, atol=1e-12, rtol=0)
    assert ((p > 0) == (ref > 0)).all()  # the support, exactly
    assert (p[4] == 0).all() and (p[5, n // 2 :] == 0).all() and p[6, n // 3] == 1.0


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_float32_equals_float64_reference_to_rounding(path, alpha):
    x = _rows(1000, torch.float32)
    p = _map(alpha)(x)
    assert p.dtype == torch.float32
    # the C kernels keep the threshold as c + d (d: the last closed-form correction) in float32
    torch.testing.assert_close(p.double(), _ref(alpha)(x), atol=3e-7 if path == "native" else 2e-6, rtol=0)
    finite = [i for i in range(20) if i != 4]
    # a float32 threshold off by e moves a row's sum by |support| * e: 1000-wide rows with a wide
    # support measured up to 3.1e-6 on a CPU without AVX-512 (the kernels' scalar sweeps)
    torch.testing.assert_close(p[finite].double().sum(-1), torch.ones(19, dtype=torch.float64),
                               atol=5e-6, rtol=0)


@needs_native
@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_equals_pytorch_path_forward_and_backward(monkeypatch, alpha, dtype):
    x = torch.randn(4, 16, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    x[0, 0, 100:] = float("-inf")
    x[0, 1] = float("-inf")
    x = x.to(dtype)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    res = []
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTNOPT_NATIVE", flag)
        xr = x.clone().requires_grad_(True)
        p = _map(alpha)(xr)
        (p * w).sum().backward()
        res.append((p.detach(), xr.grad))
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(res[0][0], res[1][0], atol=tol, rtol=0)
    torch.testing.assert_close(res[0][1], res[1][1], atol=10 * tol, rtol=0)
    assert (res[0][1][0, 1] == 0).all()  # all -inf row: zero gradient


@needs_native
def test_native_kernel_runs_where_usable(monkeypatch):
    calls = []
    real = _sparse_native.forward
    monkeypatch.setattr(_sparse_native, "forward", lambda *a: calls.append(a[1]) or real(*a))
    x = torch.randn(3, 50, dtype=torch.float64)
    sparsemax(x)
    entmax(x, 1.5)
    entmax(x.t(), 1.5, dim=0)  # not the last dim: the PyTorch path
    entmax(x.half(), 1.5)  # half precision: computed in float32, natively
    assert calls == [2.0, 1.5, 1.5]
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    sparsemax(x)
    assert calls == [2.0, 1.5, 1.5]


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_gradcheck(path, alpha):
    x = torch.randn(3, 2, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[0, 1, 5:] = float("-inf")
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: _map(alpha)(t), (x,))
    xt = x.detach().transpose(1, 2).requires_grad_(True)  # not contiguous along the last dim
    assert torch.autograd.gradcheck(lambda t: _map(alpha)(t, dim=1), (xt,))


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_non_contiguous_rows(path, alpha):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    view = x[:, ::2]
    torch.testing.assert_close(_map(alpha)(view), _ref(alpha)(view), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_posinf_raise(path, alpha, bad):
    x = torch.randn(4, 9, dtype=torch.float64)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        _map(alpha)(x)


@needs_native
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_two_threads_give_identical_results(alpha):
    x = torch.randn(80, 1024, generator=torch.Generator().manual_seed(5))  # > 2^16 entries: 2 threads
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    res = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            xr = x.clone().requires_grad_(True)
            p = _map(alpha)(xr)
            (p * w).sum().backward()
            res.append((p.detach(), xr.grad))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


@needs_native
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_threshold_recomputes_the_map(alpha):
    """θ is in the units of ``map_from_threshold`` (what the blocked attention relies on)."""
    x = _rows(257)
    p, theta = entmax_mod.threshold_map(x, alpha, -1, 1000, 1e-12)
    torch.testing.assert_close(map_from_threshold(x, theta, alpha, -1), p, atol=1e-12, rtol=0)


@needs_native
def test_unsettled_rows_are_reported_and_rerun(monkeypatch):
    x = _rows(1000)
    # one sweep is not enough for most rows: they are reported, never returned wrong
    p, _, redo = _sparse_native.forward(x, 1.5, 1)
    assert 0 < redo.numel() < 20
    done = torch.ones(20, dtype=torch.bool)
    done[redo] = False
    torch.testing.assert_close(p[done], entmax15_sort(x)[done], atol=1e-12, rtol=0)
    # entmax reruns the reported rows on the PyTorch search
    real = _sparse_native.forward

    def garbling(*args):
        p, theta, _ = real(*args)
        p[::3] = float("nan")
        return p, theta, torch.arange(0, 20, 3)

    monkeypatch.setattr(_sparse_native, "forward", garbling)
    for alpha in (1.5, 2.0):
        torch.testing.assert_close(_map(alpha)(x), _ref(alpha)(x), atol=1e-12, rtol=0)
        view = torch.cat([x, x], dim=1)[:, ::2]  # not contiguous: the rerun reads it as it is
        torch.testing.assert_close(_map(alpha)(view), _ref(alpha)(view), atol=1e-12, rtol=0)
