"""The fused Fourier-feature attention node (IKA_S / IKA_NS at short sequences) vs loop oracles."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import _fourier_c
from attnopt.functional.kernel.fourier import fused_fourier_attention
from tests._marks import needs_native
from tests.reference import kernel as ref


@pytest.fixture(params=["whole", "heads", "rows"])
def blocks(request, monkeypatch):
    """The node's Nq × Nk passes at once (F kept), by blocks of heads, by blocks of query rows."""
    if request.param != "whole":
        monkeypatch.setattr(THRESHOLDS, "kernel_whole_elements", 0)
        monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 45 if request.param == "heads" else 7)
    return request.param


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
@pytest.mark.parametrize("nq", [4, 5])  # Nq = Nk = 5: [Q; K] stacked on a leading axis
def test_values_and_gradcheck(n_sets, w_batch, nq, blocks):
    q, k, v, ws, m = _setup(n_sets, w_batch, seed=len(w_batch) + 3 * n_sets, nq=nq)
    r = ws[0].shape[-2]
    coef = 1 / math.sqrt(r) if n_sets == 1 else 1 / (2 * math.sqrt(r))
    out = fused_fourier_attention(q, k, m, v, 1e-3, coef, ws)
    torch.testing.assert_close(out, _oracle(q, k, v, ws, m, 1e-3), rtol=1e-10, atol=1e-12)

    def fn(q, k, v, m, *ws):
        return fused_fourier_attention(q, k, m, v, 1e-3, coef, list(ws))

    assert torch.autograd.gradcheck(fn, (q, k, v, m, *ws), fast_mode=True)


def test_fully_masked_rows_are_zero_with_finite_gradients(blocks):
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


@pytest.mark.parametrize(("p", "n_sets", "nq"), [(None, 2, 4), (1.0, 1, 4), (1.5, 2, 4), (2.0, 1, 4),
                                                 (1.5, 2, 5), (2.0, 1, 5)])
def test_magnitude_node_matches_loop_oracle_and_gradcheck(p, n_sets, nq, blocks):
    """Features, L^p key magnitude and key mask in one node vs eq. 9 + 11 with loops (Nq = Nk = 5:
    the layout with [Q; K] stacked on a leading axis)."""
    from attnopt.functional.kernel.fourier import fused_fourier_magnitude_attention

    q, k, v, ws, _ = _setup(n_sets, (2, 1), seed=7 + n_sets, nq=nq)
    with torch.no_grad():
        k[0, 1, 2, 1] = 0.0  # an exact zero coordinate (p = 1: sign 0; p > 1: |k|^{p-1} = 0)
    r = ws[0].shape[-2]
    coef = 1 / math.sqrt(r) if n_sets == 1 else 1 / (2 * math.sqrt(r))
    points = torch.cat([w.detach() for w in ws], dim=-2).requires_grad_()
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[1, ..., :2] = False
    keep_all = keep.clone()
    keep_all[0] = False  # batch 0: every key masked, zero output
    scale = 0.7
    for mask in (keep, keep_all):
        key_mask = torch.zeros(2, 1, 5, dtype=torch.float64).masked_fill_(~mask.squeeze(-2), float("-inf"))
        out = fused_fourier_magnitude_attention(q, k, v, points, n_sets, coef, 1e-3, p, scale, key_mask)
        for b in range(2):
            for h in range(2):
                pts = [w.expand(2, 2, *w.shape[-2:])[b, h].detach() for w in ws]
                if n_sets == 1:
                    sim = lambda x, y, pts=pts: ref.random_fourier(x, y, pts[0])  # noqa: E731
                else:
                    sim = lambda x, y, pts=pts: ref.nonstationary_fourier(x, y, *pts)  # noqa: E731
                wts = ref.kernel_weights(q[b, h].detach(), k[b, h].detach(), sim, squared=True, p=p,
                                         scale=scale, eps=1e-3, mask=mask[b, 0].expand(nq, 5))
                torch.testing.assert_close(out[b, h], wts @ v[b, h].detach(), rtol=1e-10, atol=1e-12)

        def fn(q, k, v, w, key_mask=key_mask):
            return fused_fourier_magnitude_attention(q, k, v, w, n_sets, coef, 1e-3, p, scale, key_mask)

        assert torch.autograd.gradcheck(fn, (q, k, v, points), fast_mode=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("p", [None, 1.0, 2.0])
def test_kernel_attention_short_path_equals_general_path_float32(p, monkeypatch):
    """The dispatched short path and the chunked path agree in float32 (values and gradients)."""
    from attnopt.functional import dispatch
    from attnopt.functional.kernel import kernel_attention
    from attnopt.kernels import NonStationaryFourier

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g).requires_grad_() for _ in range(3))
    pts = (torch.randn(3, 12, 8, generator=g) * 0.4).requires_grad_()
    keys = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keys[0, ..., 5:] = False

    def run():
        kern = NonStationaryFourier.stacked(pts)
        out = kernel_attention(q, k, v, kernel=kern, magnitude_p=p, attn_mask=keys)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v, pts))

    short, gs = run()
    assert dispatch.last_dispatch["kernel"] == "materialized"
    monkeypatch.setitem(dispatch.CROSSOVERS, "kernel", {"float32": 0, "float64": 0, "half": 0})
    general, gg = run()
    assert dispatch.last_dispatch["kernel"] == "streaming"
    torch.testing.assert_close(short, general, rtol=2e-5, atol=2e-6)
    for a, b in zip(gs, gg, strict=True):  # gradients up to ~50 here: float32 rounding ~1e-6 of that
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()) * 10)


def test_stacked_kernel_equals_two_sets():
    from attnopt.kernels import NonStationaryFourier

    g = torch.Generator().manual_seed(4)
    w1, w2 = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    a, b = NonStationaryFourier(w1, w2), NonStationaryFourier.stacked(torch.cat([w1, w2], dim=-2))
    x = torch.randn(3, 6, 5, generator=g)
    torch.testing.assert_close(a(x, x), b(x, x), rtol=0, atol=0)
    assert torch.equal(a.fourier_stack()[0], b.fourier_stack()[0])
    with pytest.raises(ValueError, match="2R"):
        NonStationaryFourier.stacked(torch.randn(3, 5))
    with pytest.raises(ValueError, match="finite"):
        NonStationaryFourier.stacked(torch.full((4, 5), float("nan")))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_lp_magnitude_matches_torch_path(dtype, monkeypatch):
    """``_native/lp_magnitude.c`` and the PyTorch ops of ``_magnitude``: a, u, c to rounding
    (exact zeros, an all-zero row, a row past the clamp), and the node's output and gradients."""
    from attnopt.functional.kernel import fourier as kf

    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 3, 6, 7, generator=g, dtype=dtype)
    k[0, 0, 1, 2] = 0.0
    k[1, 2, 3] = 0.0
    k[1, 1, 4] = torch.finfo(dtype).max / 4  # past the clamp: a = cap, c = 0
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for p in (1.0, 1.3, 1.5, 2.0):
        for grad in (True, False):
            native = _fourier_c._magnitude(k, p, 0.3, grad)
            assert _fourier_c._magnitude_native(k, p, 0.3, grad, torch.finfo(dtype).max / 8) is not None
            with monkeypatch.context() as m:
                m.setenv("ATTNOPT_NATIVE", "0")
                m.setattr(_native, "_LIBS", {})
                plain = _fourier_c._magnitude(k, p, 0.3, grad)
            for x, y in zip(native, plain, strict=True):
                if y is None:
                    assert x is None
                else:
                    torch.testing.assert_close(x, y, **tol)
    q, kk, v = (torch.randn(2, 2, 5, 4, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    pts = torch.randn(6, 4, generator=g, dtype=dtype)

    def run():
        coef = 1 / (2 * math.sqrt(3))
        out = kf.fused_fourier_magnitude_attention(q, kk, v, pts, 2, coef, 1e-3, 1.5, 0.5, None)
        return (out, *torch.autograd.grad(out.square().sum(), (q, kk, v)))

    got = run()
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})
    if dtype == torch.float32:  # the node's C sin/cos round differently from torch's (~1e-7)
        tol = {"rtol": 1e-4, "atol": 1e-5}
    for x, y in zip(got, run(), strict=True):
        torch.testing.assert_close(x, y, **tol)


@needs_native
def test_native_lp_magnitude_split_over_threads(monkeypatch):
    """Rows split over threads (``parallel_rows``) give the one-call result."""

    k = torch.randn(3, 41, 16, generator=torch.Generator().manual_seed(2))
    one = _fourier_c._magnitude(k, 1.5, 0.25, True)
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    for x, y in zip(_fourier_c._magnitude(k, 1.5, 0.25, True), one, strict=True):
        assert torch.equal(x, y)


def _node_case(dtype, points_batch, nq, p, masked, seed=11):
    """Inputs of the magnitude node: q (2, 3, nq, 4), k, v (2, 3, 6, 4 / 5), points (…, 2R, 4)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, nq, 4, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(2, 3, 6, 4, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(2, 3, 6, 5, generator=g, dtype=dtype).requires_grad_()
    pts = (torch.randn(*points_batch, 6, 4, generator=g, dtype=dtype) * 0.7).requires_grad_()
    key_mask = None
    if masked:
        key_mask = torch.zeros(2, 3, 6, dtype=dtype)
        key_mask[0, 1, 2:] = float("-inf")
        key_mask[1, 2] = float("-inf")  # a fully masked head: zero rows, finite gradients
        key_mask[1, 0, 0] = -0.5
    return q, k, v, pts, key_mask


def _node_run(q, k, v, pts, key_mask, p):
    from attnopt.functional.kernel.fourier import fused_fourier_magnitude_attention

    out = fused_fourier_magnitude_attention(q, k, v, pts, 2, 1 / (2 * math.sqrt(3)), 1e-3, p, 0.6, key_mask)
    dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out, *torch.autograd.grad(out, (q, k, v, pts), dout))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("points_batch", "nq"), [((), 6), ((2, 3), 6), ((3,), 6), ((), 4), ((2, 3), 4)])
@pytest.mark.parametrize(("p", "masked"), [(None, False), (1.5, True), (2.0, False), (None, True)])
def test_native_passes_match_torch_path(dtype, points_batch, nq, p, masked, monkeypatch):
    """``_native/fourier_features.c`` (features, key weights, O, G, key gradients, dP) and the PyTorch
    ops: output and gradients of q, k, v and the points, for points shared, per head or per example
    and head (one bmm per side), Nq = Nk (stacked) and Nq != Nk (concatenated), key masks with a
    fully masked head."""
    case = _node_case(dtype, points_batch, nq, p, masked)
    got = _node_run(*case, p)
    if masked:
        assert torch.equal(got[0][1, 2], torch.zeros_like(got[0][1, 2]))
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})
    want = _node_run(*case, p)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol)


@needs_native
def test_native_node_per_example_points_gradcheck():
    """The native path with per-example points (B, H, S·R, d), a mask and the L^1.5 magnitude, float64."""
    q, k, v, pts, key_mask = _node_case(torch.float64, (2, 3), 6, 1.5, True)
    from attnopt.functional.kernel.fourier import fused_fourier_magnitude_attention

    def fn(q, k, v, pts):
        return fused_fourier_magnitude_attention(q, k, v, pts, 2, 0.3, 1e-3, 1.5, 0.6, key_mask)

    assert torch.autograd.gradcheck(fn, (q, k, v, pts), fast_mode=True)


@needs_native
def test_native_passes_split_over_threads(monkeypatch):
    """Rows split over threads (two passes in one C call share each thread's fraction of rows)
    give the one-call result bit for bit."""
    case = _node_case(torch.float32, (2, 3), 6, 1.5, True)
    one = _node_run(*case, 1.5)
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    for a, b in zip(_node_run(*case, 1.5), one, strict=True):
        assert torch.equal(a, b)


@needs_native
def test_native_sincos_large_and_exact_arguments():
    """float32 sin/cos of the C pass: ~1e-7 of libm in double on [-8192, 8192], libm beyond."""
    from attnopt.functional.kernel import _fourier_pass as kf

    x = torch.cat([torch.linspace(-8192, 8192, 40001), torch.tensor([0.0, -0.0, 1e4, -3e5, 1e30, 1e-30])])
    x = x[: x.numel() // 2 * 2].view(-1, 2)  # rows of one set of R = 2 points
    fns = _fourier_c._fns(x)
    assert fns is not None
    phi, cp, sp = kf._features(fns, x, 1, 2)
    xd = x.double()
    torch.testing.assert_close(cp.double(), xd.cos(), rtol=0, atol=2e-7)
    torch.testing.assert_close(sp.double(), xd.sin(), rtol=0, atol=2e-7)
    assert torch.equal(phi, torch.cat([cp, sp], dim=-1))


def test_strided_inputs_equal_contiguous():
    """q, k, v as the (B, N, H, d) -> (B, H, N, d) views of a projection give the same node."""
    from attnopt.functional.kernel import kernel_attention
    from attnopt.kernels import NonStationaryFourier

    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 3, 3 * 4, generator=g)
    q, k, v = (t.transpose(1, 2) for t in x.split(4, dim=-1))
    kern = NonStationaryFourier.gaussian(3, 4, 0.5, 0.4, generator=g)
    got = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5)
    want = kernel_attention(q.contiguous(), k.contiguous(), v.contiguous(), kernel=kern, magnitude_p=1.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
