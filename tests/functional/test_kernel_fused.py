"""The fused Fourier-feature attention node (IKA_S / IKA_NS at short sequences) vs loop oracles."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.functional._kernel_fused import fused_fourier_attention
from tests.reference import kernel as ref


def _setup(n_sets, w_batch, seed=0, b=2, h=2, nq=4, nk=5, d=3, r=3):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    q = torch.randn(b, h, nq, d, generator=g, dtype=dt).requires_grad_()
    k = torch.randn(b, h, nk, d, generator=g, dtype=dt).requires_grad_()
    v = torch.randn(b, h, nk, 2, generator=g, dtype=dt).requires_grad_()
    ws = [torch.randn(*w_batch, r, d, generator=g, dtype=dt).requires_grad_() for _ in range(n_sets)]
    m = torch.rand(b, 1, 1, nk, generator=g, dtype=dt) + 0.1
    m[1, ..., 2:] = 0.0  # masked keys carry weight 0
    return q, k, v, ws, m.requires_grad_()


def _oracle(q, k, v, ws, m, eps):
    """out_i = Σ_j (f_ij² + ε) m_j v_j / Σ_j (f_ij² + ε) m_j with f from the loop kernels."""
    b, h, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    out = torch.zeros(b, h, nq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            pts = [w.expand(b, h, *w.shape[-2:])[bi, hi].detach() for w in ws]
            for i in range(nq):
                x = q[bi, hi, i].detach()
                wts = []
                for j in range(nk):
                    y = k[bi, hi, j].detach()
                    if len(pts) == 1:
                        f = ref.random_fourier(x, y, pts[0])
                    else:
                        f = ref.nonstationary_fourier(x, y, *pts)
                    wts.append((f * f + eps) * float(m.detach()[bi, 0, 0, j]))
                total = sum(wts)
                if total > 0:
                    out[bi, hi, i] = sum(wj * v[bi, hi, j].detach() for j, wj in enumerate(wts)) / total
    return out


@pytest.mark.parametrize("n_sets", [1, 2])
@pytest.mark.parametrize("w_batch", [(), (2, 2)])
def test_values_and_gradcheck(n_sets, w_batch):
    q, k, v, ws, m = _setup(n_sets, w_batch, seed=len(w_batch) + 3 * n_sets)
    r = ws[0].shape[-2]
    coef = 1 / math.sqrt(r) if n_sets == 1 else 1 / (2 * math.sqrt(r))
    out = fused_fourier_attention(q, k, m, v, 1e-3, coef, ws)
    torch.testing.assert_close(out, _oracle(q, k, v, ws, m, 1e-3), rtol=1e-10, atol=1e-12)

    def fn(q, k, v, m, *ws):
        return fused_fourier_attention(q, k, m, v, 1e-3, coef, list(ws))

    assert torch.autograd.gradcheck(fn, (q, k, v, m, *ws), fast_mode=True)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v, ws, m = _setup(2, (2,))
    m = torch.zeros_like(m).requires_grad_()
    out = fused_fourier_attention(q, k, m, v, 1e-5, 0.5, ws)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in (q, k, v, *ws):
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_no_key_weight_and_grads_only_where_needed():
    q, k, v, ws, _ = _setup(1, ())
    w = ws[0].detach()
    out = fused_fourier_attention(q, k, None, v, 1e-5, 1 / math.sqrt(3), [w])
    ones = torch.ones(2, 1, 1, 5, dtype=torch.float64)
    torch.testing.assert_close(out, _oracle(q, k, v, [w], ones, 1e-5), rtol=1e-10, atol=1e-12)
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(gq).all()


@pytest.mark.parametrize("p", [1.0, 1.3, 1.5])
def test_lp_magnitude_node_values_and_gradcheck(p):
    from attnopt.functional.kernel import log_magnitude

    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[0, 0, 1] = 0.0  # an exact zero coordinate: gradient 0 there for p > 1, finite for p = 1
    x[1, 2] = 0.0  # an all-zero row: magnitude 0, gradient 0
    x.requires_grad_()
    expected = [0.5 * 0.3 * ref.lp_norm_sq(row, p) for row in x.detach().reshape(-1, 4)]
    got = log_magnitude(x, p, 0.3)
    torch.testing.assert_close(got.reshape(-1), torch.tensor(expected, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x: log_magnitude(x, p, 0.3), (x,))
    (g,) = torch.autograd.grad(got.sum(), x)
    assert torch.equal(g[1, 2], torch.zeros(4, dtype=torch.float64))
