"""The Triton kernels on a real CUDA device (``pytest -m gpu``; skipped without CUDA).

bf16 tolerances: bf16 keeps 8 mantissa bits (unit roundoff 2^-8 ≈ 3.9e-3); outputs are convex
combinations of O(1) values, so their error against float64 stays within a few roundings:
``|out − ref|∞ ≤ 3e-2`` and ``‖grad − ref‖ / ‖ref‖ ≤ 5e-2`` (relative norm: gradients are sums of
N products, whose rounding grows like √N ulps). float32 runs IEEE products (no TF32):
``|out − ref|∞ ≤ 1e-4``. Memory is checked to be O(N): fwd+bwd at N = 8192 allocates a small
multiple of the inputs, far below one ``N × N`` float32 matrix (256 MiB).
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
)
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.functional.regularized import regularized_attention, regularized_attention_weights
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from attnopt.kernels import NonStationaryFourier, RandomFourier
from tests.functional.triton._helpers import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]

B, H, N, D = 2, 4, 1000, 64  # N not a block multiple


def _inputs(dtype, n=N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, D, device="cuda", generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _key_padding():
    m = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
    m[1, ..., 700:] = False
    return m


def _compare(fn, ref_fn, dtype, out_tol, grad_tol, extra=()):
    q, k, v = _inputs(dtype)
    with attnopt.backend("auto"):  # CUDA + triton: the router picks the kernels itself
        out = fn(q, k, v)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = ref_fn(q64, k64, v64)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= out_tol
    r = torch.randn_like(ref)
    got = torch.autograd.grad((out.double() * r).sum(), (q, k, v, *extra))
    want = torch.autograd.grad((ref * r).sum(), (q64, k64, v64))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert (a.double() - b).norm() / b.norm() <= grad_tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dnas_cuda(dtype, causal):
    m = _key_padding()
    tol = (3e-2, 5e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    kw = dict(attn_mask=m, is_causal=causal, causal="plan")  # the kernels' causal variant
    _compare(lambda q, k, v: doubly_normalized_attention(q, k, v, **kw),
             lambda q, k, v: doubly_normalized_weights(q, k, **kw) @ v, dtype, *tol)
    assert dispatch.last_dispatch["doubly_normalized"] == "triton"


def test_sinkhorn3_and_hnas_cuda_bf16():
    w = torch.tensor([0.2, 0.5, 0.7, 0.9], device="cuda")
    _compare(lambda q, k, v: hybrid_normalized_attention(q, k, v, w),
             lambda q, k, v: hybrid_normalized_weights(q, k, w.double()) @ v, torch.bfloat16, 3e-2, 5e-2)
    assert dispatch.last_dispatch["hybrid_normalized"] == "triton"
    _compare(lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=3),
             lambda q, k, v: doubly_normalized_weights(q, k, iterations=3) @ v, torch.bfloat16, 3e-2, 5e-2)


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.25)])
def test_entmax_cuda_bf16(reg):
    m = _key_padding()
    kw = dict(regularizer=reg, attn_mask=m, is_causal=True)
    _compare(lambda q, k, v: regularized_attention(q, k, v, **kw),
             lambda q, k, v: regularized_attention_weights(q, k, **kw) @ v, torch.bfloat16, 3e-2, 5e-2)
    assert dispatch.last_dispatch["sparse"] == "triton"


def test_ikan_cuda_bf16():
    w = torch.randn(H, 32, D, device="cuda") / 8
    kern, kern64 = RandomFourier(w), RandomFourier(w.double())
    _compare(lambda q, k, v: kernel_attention(q, k, v, kernel=kern, magnitude_p=1.0),
             lambda q, k, v: kernel_weights(q, k, kernel=kern64, magnitude_p=1.0) @ v,
             torch.bfloat16, 3e-2, 5e-2)
    assert dispatch.last_dispatch["kernel"] == "triton"


def test_mikan_cuda_bf16_gradients_reach_the_points():
    """The fused random-Fourier pass (non-stationary stacked points, in-kernel L^1.5 magnitude, key
    padding) against float64, the points' gradient included."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(H, 64, D, device="cuda", generator=g) / 8).requires_grad_()
    w64 = w.detach().double().requires_grad_()
    m = _key_padding()
    q, k, v = _inputs(torch.bfloat16)
    with attnopt.backend("auto"):
        out = kernel_attention(q, k, v, kernel=NonStationaryFourier.stacked(w), magnitude_p=1.5, attn_mask=m)
    assert dispatch.last_dispatch["kernel"] == "triton"
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kern64 = NonStationaryFourier.stacked(w64)
    ref = kernel_weights(q64, k64, kernel=kern64, magnitude_p=1.5, attn_mask=m) @ v64
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() <= 3e-2
    r = torch.randn_like(ref)
    got = torch.autograd.grad((out.double() * r).sum(), (q, k, v, w))
    want = torch.autograd.grad((ref * r).sum(), (q64, k64, v64, w64))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a.double() - b).norm() / b.norm() <= 5e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ika_linear_causal_scan_cuda(dtype):
    """The causal linear mode's chunked scan (float32 IEEE products inside) against the float64
    quadratic weights; float32 tolerances follow the linear form's amplified rounding
    (``kernel_attention``'s docstring: ~1e-3 output, ~4e-3 gradients relative to the largest entry)."""
    w = torch.randn(H, 16, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) / 8
    m = _key_padding()
    kw = dict(magnitude_p=1.0, attn_mask=m, is_causal=True)
    tol = (3e-2, 5e-2) if dtype == torch.bfloat16 else (2e-3, 1e-2)
    _compare(lambda q, k, v: kernel_attention(q, k, v, kernel=RandomFourier(w), mode="linear", **kw),
             lambda q, k, v: kernel_weights(q, k, kernel=RandomFourier(w.double()), **kw) @ v, dtype, *tol)
    assert dispatch.last_dispatch["kernel"] == "triton"


@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_implicit_kernel_modules_on_cuda_take_the_fused_kernel(variant):
    """The IKAN / MIKAN modules on CUDA (auto routing, float32, training mode, key padding): the fused
    kernel runs and the density networks (and the copula) get finite gradients."""
    from attnopt.nn import ImplicitKernelAttention

    mod = ImplicitKernelAttention(64, 4, variant, num_samples=16, p=1.5, seed=0).cuda().train()
    x = torch.randn(2, 300, 64, device="cuda")
    pad = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    pad[1, 200:] = True
    out = mod(x, x, x, key_padding_mask=pad)[0]
    assert dispatch.last_dispatch["kernel"] == "triton"
    (out.float().square().mean() + mod.kl().mean()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mod.parameters())


def test_ika_memory_is_linear_in_n():
    n = 8192
    q, k, v = _inputs(torch.bfloat16, n=n)
    kern = RandomFourier(torch.randn(H, 32, D, device="cuda") / 8)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kernel_attention(q, k, v, kernel=kern, magnitude_p=1.0).float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * 2**20, f"{extra / 2**20:.1f} MiB"  # one N×N float32 matrix is 256 MiB


def test_ika_under_torch_compile_matches_eager():
    q, k, v = _inputs(torch.bfloat16, n=512)
    kern = RandomFourier(torch.randn(H, 32, D, device="cuda") / 8)
    eager = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.0)
    compiled = torch.compile(lambda a, b, c: kernel_attention(a, b, c, kernel=kern, magnitude_p=1.0))(q, k, v)
    assert (compiled.float() - eager.float()).abs().max() < 1e-2


def test_dnas_memory_is_linear_in_n():
    n = 8192
    q, k, v = _inputs(torch.bfloat16, n=n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    doubly_normalized_attention(q, k, v, is_causal=True, causal="plan").float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * 2**20, f"{extra / 2**20:.1f} MiB"  # one N×N float32 matrix is 256 MiB


def test_dnas_under_torch_compile_matches_eager():
    q, k, v = _inputs(torch.bfloat16, n=512)
    eager = doubly_normalized_attention(q, k, v)
    compiled = torch.compile(lambda a, b, c: doubly_normalized_attention(a, b, c))(q, k, v)
    assert (compiled.float() - eager.float()).abs().max() < 1e-2
