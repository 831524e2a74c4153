"""The C spectral sampler (``nn/_spectral_native.py``, ``_native/spectral_sample.c``) against the
written-out math in float64, against the PyTorch node (``ATTNOPT_NATIVE=0``) in float32, gradcheck,
the fallback conditions, double backward and the module with padded keys."""
from __future__ import annotations

import ctypes

import pytest
import torch

import attnopt.functional.kernel.spectral as sf
from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import sample_spectral_points
from attnopt.functional.kernel import spectral_cpu as sn
from attnopt.nn.implicit_kernel import ImplicitKernelAttention
from tests.nn.test_spectral_fused import _copula_reference, _densities, _reference

pytestmark = pytest.mark.skipif(_native.compiler() is None, reason="no C compiler on this machine")
F64 = torch.float64


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)


def _plain_path(monkeypatch):
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})


def _node(pts):
    return type(pts.grad_fn).__name__


@pytest.mark.parametrize("copula", [False, True])
@pytest.mark.parametrize(("n_sets", "lead", "d", "hidden", "half"),
                         [(2, (3, 3), 3, 5, 2),          # sizes off the register blocks
                          (1, (3,), 4, 3, 1),            # no batch dim, one set
                          (3, (1, 2, 3), 3, 5, 2),       # two batch dims, three sets
                          (2, (3, 3), 16, 32, 3)])       # full column blocks, rows left over
def test_native_matches_the_written_out_math(n_sets, lead, d, hidden, half, copula):
    """Values and every gradient (h, the noise, each parameter, the copula's raw) in float64."""
    g = torch.Generator().manual_seed(n_sets + d)
    dens = _densities(n_sets, d=d, r=2 * half, hidden=hidden, scales=[0.3 + 0.2 * i for i in range(n_sets)])
    heads = lead[-1]
    h = torch.randn(*lead, d, generator=g, dtype=F64).requires_grad_()
    noise = torch.randn(n_sets, *lead, half, d, generator=g, dtype=F64).requires_grad_()
    raw = torch.randn(heads, heads, generator=g, dtype=F64).requires_grad_() if copula else None
    params = sf.fusable(dens)
    assert sn.library(h, noise, raw, params) is not None
    pts, kl = sample_spectral_points(h, noise, dens, params, raw)
    assert _node(pts) == "_NativeSpectralSampleBackward"
    ref_pts, ref_kl = _copula_reference(h, noise, dens, raw) if copula else _reference(h, noise, dens)
    torch.testing.assert_close(pts, ref_pts, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-12)
    gp, gk = torch.randn(pts.shape, generator=g, dtype=F64), torch.randn(kl.shape, generator=g, dtype=F64)
    leaves = (h, noise, *((raw,) if copula else ()), *params)
    got = torch.autograd.grad((pts, kl), leaves, (gp, gk))
    want = torch.autograd.grad((ref_pts, ref_kl), leaves, (gp, gk))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_native_gradcheck_with_copula_and_broadcast_noise():
    g = torch.Generator().manual_seed(3)
    dens = _densities(2, d=2, r=2, hidden=3, scales=(0.5, 0.8))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(2, 3, 2, generator=g, dtype=F64).requires_grad_()
    noise = torch.randn(2, 1, 3, 1, 2, generator=g, dtype=F64).requires_grad_()  # the eval buffer's broadcast
    raw = torch.randn(3, 3, generator=g, dtype=F64).requires_grad_()

    def fn(h, noise, raw, *ps):
        return sample_spectral_points(h, noise, dens, list(ps), raw)

    assert _node(fn(h, noise, raw, *params)[0]) == "_NativeSpectralSampleBackward"
    assert torch.autograd.gradcheck(fn, (h, noise, raw, *params))
    assert torch.autograd.gradcheck(lambda h, *ps: fn(h, noise.detach(), None, *ps), (h, *params))


def test_native_double_backward_is_exact():
    """create_graph=True differentiates the plain ops: gradgradcheck through the C node."""
    g = torch.Generator().manual_seed(6)
    dens = _densities(2, d=2, r=2, hidden=3, scales=(0.5, 0.8))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(2, 2, 2, generator=g, dtype=F64).requires_grad_()
    noise = torch.randn(2, 2, 2, 1, 2, generator=g, dtype=F64).requires_grad_()
    raw = torch.randn(2, 2, generator=g, dtype=F64).requires_grad_()

    def fn(h, noise, raw, w1a, w2b):
        ps = list(params)
        ps[0], ps[6] = w1a, w2b
        return sample_spectral_points(h, noise, dens, ps, raw)

    assert _node(fn(h, noise, raw, params[0], params[6])[0]) == "_NativeSpectralSampleBackward"
    assert torch.autograd.gradgradcheck(fn, (h, noise, raw, params[0], params[6]))


@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_native_float32_agrees_with_the_pytorch_node(variant, monkeypatch):
    """The module's sizes (d = 64, hidden 32, R = 16, H = 8) in float32: the C path (tanh a rational
    approximation, FMA sums) and the PyTorch node agree to float32 rounding (5e-5 of each tensor's
    largest entry: over 30 initializations the largest gap was 3.9e-5, in the noise's gradient)."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)  # the networks' first layers start from the global generator: not the test order
    mod = ImplicitKernelAttention(512, 8, variant, num_samples=16, p=1.5, seed=0)
    with torch.no_grad():
        for prm in mod.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.3)
    params = sf.fusable(mod.densities)
    raw = mod.copula.raw if mod.copula is not None else None
    h = torch.randn(3, 8, 64, generator=g).requires_grad_()  # M = 24: register blocks and rows left over
    noise = torch.randn(2, 3, 8, 8, 64, generator=g).requires_grad_()
    leaves = (h, noise, *((raw,) if raw is not None else ()), *params)
    gp, gk = torch.randn(3, 8, 32, 64, generator=g), torch.randn(3, generator=g)

    def run():
        pts, kl = sample_spectral_points(h, noise, mod.densities, params, raw)
        return _node(pts), (pts, kl, *torch.autograd.grad((pts, kl), leaves, (gp, gk)))

    node, got = run()
    assert node == "_NativeSpectralSampleBackward"
    _plain_path(monkeypatch)
    node, want = run()
    assert node == "_SpectralSampleBackward"
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().clamp_min(1.0)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=5e-5)


def test_float32_tanh_within_8_ulp():
    lib = _native.library("spectral_sample")
    assert lib is not None
    tiny = torch.logspace(-9, 1, 5000)
    x = torch.cat([torch.linspace(-12, 12, 200_001), tiny, -tiny,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    y = x.clone()
    lib.ss_tanh_test_f32(ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(y.numel()))
    ref = torch.tanh(x.double())
    ulp = (torch.nextafter(ref.float().abs(), torch.tensor(float("inf"))) - ref.float().abs()).double()
    fin = ref.isfinite()
    assert ((y.double()[fin] - ref[fin]).abs() / ulp[fin]).max() <= 8
    assert y[-5:-1].tolist() == [0.0, 0.0, 1.0, -1.0] and y[-1].isnan()
    assert y[:-1].abs().max() <= 1


def test_non_finite_inputs_give_the_same_nans(monkeypatch):
    dens = _densities(2, d=3, r=4, hidden=5)
    params = sf.fusable(dens)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 3, 3, generator=g, dtype=F64)
    h[0, 1, 2] = float("nan")
    h[1, 0, 0] = float("inf")
    noise = torch.randn(2, 2, 3, 2, 3, generator=g, dtype=F64)
    got = sample_spectral_points(h, noise, dens, params)
    _plain_path(monkeypatch)
    want = sample_spectral_points(h, noise, dens, params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert got[0].isnan().any() and got[0][1, 1:].isfinite().all()


def test_fallback_conditions(monkeypatch):
    """The PyTorch node runs for mixed dtypes, half precision, non-stock shapes, non-contiguous
    parameters, inside torch.func transforms, and with ATTNOPT_NATIVE=0 (the same results)."""
    dens = _densities(2, d=3, r=4, hidden=5)
    params = sf.fusable(dens)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 3, 3, generator=g, dtype=F64)
    noise = torch.randn(2, 2, 3, 2, 3, generator=g, dtype=F64)
    assert sn.library(h, noise, None, params) is not None
    assert sn.library(h.float(), noise.float(), None, params) is None  # float32 inputs, float64 parameters
    assert sn.library(h, noise, torch.zeros(3, 3), params) is None  # the copula in another dtype
    assert sn.library(h.half(), noise.half(), None, [p.half() for p in params]) is None
    odd = list(params)
    odd[2] = torch.zeros(7, 5, dtype=F64)  # W1b of another shape
    assert sn.library(h, noise, None, odd) is None
    odd[2] = params[2].t().contiguous().t()  # non-contiguous
    assert sn.library(h, noise, None, odd) is None
    native = sample_spectral_points(h, noise, dens, params)[0]

    seen = []

    def probe(x):  # inside a torch.func transform the tensors are wrapped: no storage to read
        seen.append(sn.library(x, noise, None, params))
        return x.sum()

    torch.func.grad(probe)(h)
    torch.func.vmap(probe)(h)
    assert seen == [None, None]
    threads = torch.get_num_threads()
    try:  # more threads: the C path only up to THREADED_MAX_POINTS base points (here 2·2·3·2 = 24)
        torch.set_num_threads(2)
        monkeypatch.setattr(THRESHOLDS, "spectral_threaded_max_points", 24)
        assert sn.library(h, noise, None, params) is not None
        monkeypatch.setattr(THRESHOLDS, "spectral_threaded_max_points", 23)
        assert sn.library(h, noise, None, params) is None
        torch.set_num_threads(1)
        assert sn.library(h, noise, None, params) is not None
    finally:
        torch.set_num_threads(threads)
    _plain_path(monkeypatch)
    assert sn.library(h, noise, None, params) is None
    plain = sample_spectral_points(h, noise, dens, params)[0]
    torch.testing.assert_close(plain, native, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_module_with_padded_keys_native_equals_fallback(variant, monkeypatch):
    """The whole module (head summaries over the non-padded keys, fresh noise, KL) in float64 with a
    key-padding mask, a fully padded example included: the same outputs, KL and gradients with and
    without the C sampler, and the same noise stream."""

    def run():
        torch.manual_seed(0)
        m = ImplicitKernelAttention(8, 2, variant, num_samples=4, p=1.5, seed=3).double().train()
        with torch.no_grad():
            for name, prm in m.named_parameters():
                if "nn1.2" in name or "nn2.2" in name or "copula" in name:
                    prm.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1), dtype=F64).requires_grad_()
        pad = torch.tensor([[False, False, True, True, False], [True] * 5, [False] * 5])
        outs = [m(x, x, x, key_padding_mask=pad, need_weights=False)[0] for _ in range(2)]
        weights = torch.arange(outs[0].numel(), dtype=F64).view_as(outs[0])
        loss = sum((o.nan_to_num() * weights).sum() for o in outs) + m.kl()
        grads = torch.autograd.grad(loss, [x, *m.parameters()], allow_unused=True)
        return outs, m.kl().detach(), grads

    got = run()
    _plain_path(monkeypatch)
    want = run()
    for a, b in zip([*got[0], got[1], *got[2]], [*want[0], want[1], *want[2]], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("native", [True, False])
def test_kl_mean_inside_the_node_is_the_mean_of_the_per_example_kl(native, monkeypatch):
    """``kl_mean=True`` gives ``kl.mean()`` bitwise and the same gradients (the C backward reads
    ``gkl / B`` with stride 0), on both paths; gradcheck in float64 (double backward: below)."""
    if not native:
        _plain_path(monkeypatch)
    g = torch.Generator().manual_seed(7)
    dens = _densities(2, d=3, r=4, hidden=5, scales=(0.4, 0.7))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(3, 2, 3, generator=g, dtype=F64).requires_grad_()
    noise = torch.randn(2, 3, 2, 2, 3, generator=g, dtype=F64)
    raw = torch.randn(2, 2, generator=g, dtype=F64).requires_grad_()
    pts, kl = sample_spectral_points(h, noise, dens, params, raw)
    pts_m, kl_m = sample_spectral_points(h, noise, dens, params, raw, kl_mean=True)
    assert (_node(pts_m) == "_NativeSpectralSampleBackward") == native
    assert kl_m.shape == () and torch.equal(kl_m, kl.mean()) and torch.equal(pts_m, pts)
    gp = torch.randn(pts.shape, generator=g, dtype=F64)
    leaves = (h, raw, *params)
    got = torch.autograd.grad((pts_m, 3.0 * kl_m), leaves, (gp, None))
    want = torch.autograd.grad((pts, 3.0 * kl.mean()), leaves, (gp, None))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)

    if native:  # (the PyTorch path's mean is a plain autograd op)
        def fn(h, raw, p0, p7):  # the first layer's weight and the last bias stand for the parameters
            ps = [p0, *params[1:7], p7, *params[8:]]
            return sample_spectral_points(h, noise, dens, ps, raw, kl_mean=True)

        assert torch.autograd.gradcheck(fn, (h, raw, params[0], params[7]))


def test_head_summary_inside_the_node_matches_the_mean_then_the_sampler():
    """``keys=True`` (h = the keys' mean over N, taken in the C call: a sequential sum, then the
    division): the points, KL and gradients of ``mean`` then the sampler up to rounding; gradcheck
    and exact double backward in float64."""
    g = torch.Generator().manual_seed(11)
    dens = _densities(2, d=3, r=2, hidden=4, scales=(0.5, 0.6))
    params = sf.fusable(dens)
    k = torch.randn(2, 2, 5, 3, generator=g, dtype=F64).requires_grad_()
    noise = torch.randn(2, 2, 2, 1, 3, generator=g, dtype=F64)
    pts, kl = sample_spectral_points(k, noise, dens, params, keys=True, kl_mean=True)
    assert _node(pts) == "_NativeSpectralSampleBackward"
    ref_pts, ref_kl = sample_spectral_points(k.mean(-2), noise, dens, params, kl_mean=True)
    torch.testing.assert_close(pts, ref_pts, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-13, atol=1e-13)
    gp = torch.randn(pts.shape, generator=g, dtype=F64)
    got = torch.autograd.grad((pts, 2.0 * kl), (k, *params), (gp, None))
    want = torch.autograd.grad((ref_pts, 2.0 * ref_kl), (k, *params), (gp, None))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    def fn(x):
        return sample_spectral_points(x, noise, dens, params, keys=True)

    assert torch.autograd.gradcheck(fn, (k,))
    assert torch.autograd.gradgradcheck(  # the double backward of both: the keys' mean and the KL's
        lambda x: sample_spectral_points(x, noise, dens, params, keys=True, kl_mean=True)[1], (k,))
