"""The whole-call path of kernel attention with Fourier features (``_WholeFourier``: the forward one
C call, the backward one, BLAS from C) vs the per-pass node (``_FusedFourier``) and the PyTorch ops."""
from __future__ import annotations

import math

import pytest
import torch

import attnopt.functional.kernel.fourier as kf
from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS

pytestmark = pytest.mark.skipif(_native.compiler() is None or _native.blas() is None,
                                reason="no C compiler or no BLAS in PyTorch's library")


def _case(dtype, points_batch, nq, nk=6, b=2, h=3, masked=False, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, 4, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, h, nk, 4, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, h, nk, 5, generator=g, dtype=dtype).requires_grad_()
    pts = (torch.randn(*points_batch, 6, 4, generator=g, dtype=dtype) * 0.7).requires_grad_()
    key_mask = None
    if masked:
        key_mask = torch.zeros(b, h, nk, dtype=dtype)
        key_mask[0, 1, 2:] = float("-inf")
        key_mask[-1, -1] = float("-inf")  # a fully masked head: zero rows, finite gradients
        key_mask[-1, 0, 0] = -0.5
    return q, k, v, pts, key_mask


def _run(q, k, v, pts, key_mask, p, dout=None):
    coef = 1 / (2 * math.sqrt(3))
    out = kf.fused_fourier_magnitude_attention(q, k, v, pts, 2, coef, 1e-3, p, 0.6, key_mask)
    if dout is None:
        dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out, *torch.autograd.grad(out, (q, k, v, pts), dout))


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the whole-call node."""
    calls = []
    orig = kf._WholeFourier.forward

    def forward(*args):
        calls.append(1)
        return orig(*args)

    monkeypatch.setattr(kf._WholeFourier, "forward", staticmethod(forward))
    return calls


@pytest.mark.parametrize(("points_batch", "nq"), [((), 6), ((3,), 6), ((2, 3), 4), ((2, 1), 7)])
@pytest.mark.parametrize(("p", "masked"), [(None, False), (1.5, True), (2.0, True)])
def test_whole_call_matches_node_and_torch_path(points_batch, nq, p, masked, spy, monkeypatch):
    """float64: output and gradients of q, k, v and the points (shared, per head, per example and
    head, per example), Nq = Nk and Nq != Nk, masks with a fully masked head: whole call = the node
    of C passes = the PyTorch ops."""
    case = _case(torch.float64, points_batch, nq, masked=masked)
    got = _run(*case, p)
    assert spy == [1]
    if masked:
        assert torch.equal(got[0][-1, -1], torch.zeros_like(got[0][-1, -1]))
    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 0)  # the node with its C passes
    node = _run(*case, p)
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})
    torch_ops = _run(*case, p)
    assert spy == [1]
    for a, b, c in zip(got, node, torch_ops, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-13)


def test_whole_call_float32_close_to_float64(spy):
    case64 = _case(torch.float64, (), 6, masked=True)
    case32 = tuple(None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in case64)
    for a, b in zip(_run(*case32, 1.5), _run(*case64, 1.5), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    assert spy == [1, 1]


@pytest.mark.parametrize("points_batch", [(), (2, 3)])
def test_whole_call_gradcheck(points_batch, spy):
    q, k, v, pts, key_mask = _case(torch.float64, points_batch, 5, masked=True)

    def fn(q, k, v, pts):
        return kf.fused_fourier_magnitude_attention(q, k, v, pts, 2, 0.3, 1e-3, 1.5, 0.6, key_mask)

    assert torch.autograd.gradcheck(fn, (q, k, v, pts), fast_mode=True)
    assert spy


def test_crossover_and_no_blas_take_the_node(spy, monkeypatch):
    """Above either size limit, or without PyTorch's BLAS, the node runs (same values)."""
    case = _case(torch.float64, (), 6)
    want = _run(*case, 1.5)
    assert spy == [1]
    b, h, nq, nk = 2, 3, 6, 6
    for total, head in ((b * h * nq * nk - 1, 1 << 30), (1 << 30, nq * nk - 1)):
        monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", total)
        monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_max_head_scores", head)
        for a, c in zip(_run(*case, 1.5), want, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-13)
    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", b * h * nq * nk)
    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_max_head_scores", nq * nk)
    _run(*case, 1.5)
    assert spy == [1, 1]  # at both limits: the whole call
    monkeypatch.setattr(_native, "blas", lambda: None)
    for a, c in zip(_run(*case, 1.5), want, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-13)
    assert spy == [1, 1]


@pytest.mark.parametrize("points_batch", [(), (2, 3)])
def test_heads_split_over_threads(points_batch, spy, monkeypatch):
    """Heads over 2 threads (per-thread gradient buffers of shared points summed) = 1 thread; the
    gradient of a sum (an expanded scalar) read with stride 0."""
    case = _case(torch.float64, points_batch, 6, masked=True)
    ones = torch.ones(2, 3, 6, 5, dtype=torch.float64).expand(2, 3, 6, 5)
    one = _run(*case, 1.5)
    one_sum = _run(*case, 1.5, torch.ones((), dtype=torch.float64).expand(2, 3, 6, 5))
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = _run(*case, 1.5)
        two_sum = _run(*case, 1.5, ones)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(two + two_sum, one + one_sum, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert len(spy) == 4


def test_unbatched_and_strided_inputs(spy):
    """2-D q, k, v (no batch) and transposed (B, N, H, d) views equal the contiguous batched call."""
    q, k, v, pts, _ = _case(torch.float64, (), 6, b=1, h=1)
    got = _run(q[0, 0], k[0, 0], v[0, 0], pts, None, 2.0)
    want = _run(q, k, v, pts, None, 2.0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.reshape(a.shape), rtol=1e-12, atol=1e-13)
    x = torch.randn(2, 6, 3, 12, dtype=torch.float64)
    qs, ks, vs = (t.transpose(1, 2) for t in x.split(4, dim=-1))
    out = kf.fused_fourier_magnitude_attention(qs, ks, vs, pts.detach(), 2, 0.3, 1e-3, 1.5, 0.6, None)
    qc, kc, vc = qs.contiguous(), ks.contiguous(), vs.contiguous()
    ref = kf.fused_fourier_magnitude_attention(qc, kc, vc, pts.detach(), 2, 0.3, 1e-3, 1.5, 0.6, None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    assert len(spy) == 4


def test_dispatch_mode_sees_the_products(spy):
    """Under a FLOP counter (a dispatch mode) the node runs: its matrix products are counted."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, pts, _ = _case(torch.float64, (), 6)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        kf.fused_fourier_magnitude_attention(q, k, v, pts, 2, 0.3, 1e-3, 1.5, 0.6, None)
    assert counter.get_total_flops() > 0 and not spy


def test_double_backward_refused():
    q, k, v, pts, _ = _case(torch.float64, (), 6)
    out = kf.fused_fourier_magnitude_attention(q, k, v, pts, 2, 0.3, 1e-3, 1.5, 0.6, None)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def _wide_case(dtype, points_batch, seed=11):
    """Sizes past 16 (the float32 path's 16 x 16 transposes of W and V, and their edges): Nq = 20,
    Nk = 18, d = 18, dv = 17, two sets of 9 points; a fully masked head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 20, 18, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 18, 18, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 18, 17, generator=g, dtype=torch.float64)
    pts = torch.randn(*points_batch, 18, 18, generator=g, dtype=torch.float64) * 0.4
    key_mask = torch.zeros(2, 3, 18, dtype=torch.float64)
    key_mask[0, 1, 5:] = float("-inf")
    key_mask[-1, -1] = float("-inf")
    return tuple(t.to(dtype).requires_grad_(i < 4) for i, t in enumerate((q, k, v, pts, key_mask)))


@pytest.mark.parametrize("points_batch", [(), (2, 3)])
@pytest.mark.parametrize("p", [None, 1.0, 1.5, 2.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_whole_call_p_modes_match_torch_path(points_batch, p, dtype, spy, monkeypatch):
    """Each L^p mode of the C magnitude (p = 1, 1.5 by a cube root, 2, general p by pow; no
    magnitude), shared and per-head points: output and the four gradients = the PyTorch ops.
    float64: to 1e-12 of each tensor's largest entry (gradient entries cancel); float32: off the
    float64 ops by at most 4x the float32 PyTorch ops' own error, + 2e-6 (p = 1 is badly
    conditioned: a = s·(Σ|k|)²/2 ~ 60 here, so exp(a - max) carries ~1e-5 in either path)."""
    case = _wide_case(dtype, points_batch)
    got = _run(*case, p)
    assert spy == [1]
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})
    case64 = tuple(t.detach().double().requires_grad_(t.requires_grad) for t in case)
    want = _run(*case64, p)
    if dtype == torch.float64:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12 * float(b.detach().abs().max()))
        return
    ops32 = _run(*case, p)
    for a, c, b in zip(got, ops32, want, strict=True):
        assert torch.isfinite(a).all()
        scale = b.detach().abs().max()
        err, err_ops = ((a.double() - b).abs().max() / scale), ((c.double() - b).abs().max() / scale)
        assert err <= 4 * err_ops + 2e-6, (float(err), float(err_ops))


def test_whole_call_float32_large_projections_take_libm(spy, monkeypatch):
    """float32 projections past 8192 (exact here: d = 1, q, k ~ 1e7, where the vector sin/cos would
    be far off, and power-of-2 points) get their sin/cos from libm, as in the node of C passes; a
    head with small projections beside."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(10_000_000, 30_000_000, (1, 2, 7, 1), generator=g).float()
    k = -torch.randint(10_000_000, 30_000_000, (1, 2, 6, 1), generator=g).float()
    q[0, 0], k[0, 0] = q[0, 0] / 1e7, k[0, 0] / 1e7  # head 0: |P| < 8192
    v = torch.randn(1, 2, 6, 3, generator=g)
    pts = torch.tensor([[1.0], [0.5], [0.25], [2.0]])
    q, k, v, pts = (t.requires_grad_() for t in (q, k, v, pts))
    got = _run(q, k, v, pts, None, None)[0]
    assert spy == [1]
    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 0)
    want = _run(q, k, v, pts, None, None)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wanted", [(1,), (0, 1), (2,), (3,)])
def test_whole_call_partial_gradients(wanted, spy):
    """Only some of q, k, v, points needing a gradient (the backward skips the others' products,
    e.g. no A^T g without dv): the same gradients as with all four."""
    q, k, v, pts, key_mask = _wide_case(torch.float64, (2, 3))
    full = _run(q, k, v, pts, key_mask, 1.5)
    ins = [t.detach().requires_grad_(i in wanted) for i, t in enumerate((q, k, v, pts))]
    out = kf.fused_fourier_magnitude_attention(*ins, 2, 1 / (2 * math.sqrt(3)), 1e-3, 1.5, 0.6, key_mask)
    dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    got = torch.autograd.grad(out, [ins[i] for i in wanted], dout)
    for i, gr in zip(wanted, got, strict=True):
        torch.testing.assert_close(gr, full[1 + i], rtol=1e-12, atol=1e-13)
    assert len(spy) == 2


def test_saved_tensor_hooks_that_copy_the_points_view():
    """The whole call keeps the forward's points layout for the backward; a saved-tensor hook that gives
    the (broadcast) points view back as a dense copy has other strides: the layout is then recomputed
    from the points, and the gradients are those without the hook."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pts = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64).requires_grad_()  # broadcast over heads

    def grads():
        out = kf.fused_fourier_magnitude_attention(q, k, v, pts, 1, 0.5, 1e-3, 1.5, 0.3, None)
        assert type(out.grad_fn).__name__ == "_WholeFourierBackward"
        return torch.autograd.grad(out.square().sum(), (q, k, v, pts))

    want = grads()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        got = grads()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
