"""The CPU candidate-group forward (α ∉ {1.5, 2}) and the row-block backward agree with the dense
algorithm; without the C kernels (``ATTNOPT_NATIVE=0``, every test here) sparsemax and 1.5-entmax
run their sort-based reference, which the C kernels are checked against on adversarial rows.
"""
from __future__ import annotations

import pytest
import torch

from attnopt.functional import entmax, sparsemax
from attnopt.functional.regularized import cpu as _sparse_native
from attnopt.functional.regularized import groups as _sparse_groups
from tests.reference.regularized import entmax15_sort


@pytest.fixture(autouse=True)
def _pytorch_path(monkeypatch):
    """Force the PyTorch fallback of the native kernels."""
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")


def _map(alpha):
    if alpha == 2.0:
        return lambda t, dim=-1: sparsemax(t, dim=dim)
    return lambda t, dim=-1: entmax(t, alpha, dim=dim)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 512, generator=g, dtype=torch.float64) * 2.0
    x[0, 0, 100:] = float("-inf")  # masked tail
    x[0, 1] = float("-inf")  # fully masked row
    x[0, 2] = 0.5  # all ties
    x[1, :4] *= 0.01  # nearly uniform rows: large supports
    x[2] *= 50.0  # very peaked rows
    return x.to(dtype)


@pytest.mark.parametrize(
    ("alpha", "dtype"),
    [(a, d) for a in (1.3, 1.5, 2.0) for d in (torch.float64, torch.float32)] + [(3.0, torch.float64)],
)
def test_fast_path_matches_dense_path(alpha, dtype):
    x = _inputs(dtype)
    assert _sparse_groups.usable(x, -1)
    xt = x.transpose(1, 2).contiguous()  # dim != last: the dense algorithm
    xa = x.clone().requires_grad_(True)
    xb = xt.clone().requires_grad_(True)
    pa = _map(alpha)(xa)
    pb = _map(alpha)(xb, dim=1).transpose(1, 2)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(pa, pb, atol=tol, rtol=0)
    assert (pa[0, 1] == 0).all() and (pa[0, 0, 100:] == 0).all()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    (pa * w).sum().backward()
    (pb * w).sum().backward()
    # α > 2: the Jacobian weighs p^{2−α}, large for tiny p: float32 rounding of p is amplified
    gtol = 10 * tol if alpha <= 2 or dtype == torch.float64 else 1e-3
    torch.testing.assert_close(xa.grad, xb.grad.transpose(1, 2), atol=gtol, rtol=0)
    assert (xa.grad[0, 1] == 0).all()


def test_dense_rows_fall_back_and_agree():
    x = torch.randn(2, 16, 512, dtype=torch.float64) * 0.01  # tiny range: supports are most of the row
    ref = entmax(x.transpose(1, 2).contiguous(), 1.3, dim=1).transpose(1, 2)
    torch.testing.assert_close(entmax(x, 1.3), ref, atol=1e-12, rtol=0)
    assert (entmax(x, 1.3) > 0).float().mean() > 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_path_half_precision_large_scale(dtype):
    x = (_inputs(torch.float64) * 1000).clamp(-6e4, 6e4).to(dtype).requires_grad_(True)
    for alpha in (1.5, 2.0):
        p = _map(alpha)(x)
        assert torch.isfinite(p).all() and p.dtype == dtype
        (p.float() * torch.arange(512.0)).sum().backward()
        assert torch.isfinite(x.grad).all()
        x.grad = None


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_blocks_over_threads_give_the_same_result(alpha):
    x = torch.randn(2, 640, 1024, generator=torch.Generator().manual_seed(2))  # > 1 row block
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    res = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            xr = x.clone().requires_grad_(True)
            p = _map(alpha)(xr)
            (p * w).sum().backward()
            res.append((p.detach(), xr.grad))
            assert torch.get_num_threads() == t  # restored after the pooled blocks
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def _adversarial_rows() -> torch.Tensor:
    """(2, 12, 512) float64 rows aimed at the two-pass 1.5-entmax: each kind twice (2 blocks)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 512, generator=g, dtype=torch.float64)
    x[:, 0] = 0.25  # all equal: the whole row is the support
    x[:, 1, :300] = 0.0  # 300 ties below one max, the rest far below
    x[:, 1, 300:] = -10.0
    x[:, 1, 7] = 1.0
    x[:, 2] *= 1e4  # huge spread: a one-entry support
    x[:, 3] = float("-inf")  # fully masked
    x[:, 4, 50:] = float("-inf")  # masked tail
    x[:, 5] *= 1e-3  # tiny range: every entry in the support
    x[:, 6] += 1e3  # large offset (the threshold is found relative to the max)
    x[:, 7, :5] = 4.0  # ties at the max
    # support entries sharing strided groups (view(rows, 4, 128)): the group-max guess misses
    # them, so the first check fails and the reruns / dense solver settle these rows
    x[:, 8:10] *= 0.5
    x[:, 8, torch.arange(4) * 128 + 3] = torch.tensor([3.0, 2.99, 2.98, 2.97], dtype=torch.float64)
    x[:, 9, torch.arange(4) * 128 + 5] = 3.0
    x[:, 9, torch.arange(4) * 128 + 6] = 2.9
    x[:, 10] = torch.linspace(0, 1, 512, dtype=torch.float64) ** 8 * 3  # a long tail at the threshold
    x[:, 11, ::2] = x[:, 11, 1::2]  # every value twice
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("native", ["0", "1"])
def test_entmax15_matches_sort_on_adversarial_rows(dtype, native, monkeypatch):
    """The C kernel (``native = "1"``) and the sort-based path agree with the float64 oracle."""
    monkeypatch.setenv("ATTNOPT_NATIVE", native)
    if native == "1" and not _sparse_native.library_available():
        pytest.skip("no C compiler")
    x = _adversarial_rows().to(dtype)
    ref = entmax15_sort(x)  # float64, on the same (rounded) scores
    p = entmax(x, 1.5)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(p.double(), ref, atol=tol, rtol=0)
    torch.testing.assert_close(p.sum(-1)[:, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]].double(),
                               torch.ones(2, 11, dtype=torch.float64), atol=10 * tol, rtol=0)
    assert (p[:, 3] == 0).all() and (p[:, 4, 50:] == 0).all()
    assert ((p > 0) == (ref > 0)).all() if dtype == torch.float64 else True


def test_sort_reference_matches_entmax_package():
    import entmax as entmax_pkg

    x = _adversarial_rows()[:, [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]]  # finite rows
    torch.testing.assert_close(entmax15_sort(x), entmax_pkg.entmax15(x), atol=1e-12, rtol=0)
