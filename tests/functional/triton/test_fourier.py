"""The fused random-Fourier implicit-kernel attention kernel (``triton/_fourier.py``) against float64.

Values and gradients to q, k, v and the spectral points (IKA's points are sampled from a
learned density, IKAN-direct's are parameters: both need ``dW``) under ``attnopt.backend("triton")``;
without CUDA in Triton's interpreter (``_helpers``), 16 × 16 blocks, sizes not block multiples.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.kernels import NonStationaryFourier, RandomFourier
from attnopt.nn import ImplicitKernelAttention
from tests.functional.triton._helpers import DEVICE, assert_close, blocks, grads, rand

B, H, NQ, NK, D, DV, R = 2, 1, 21, 27, 8, 6, 12


def _kernel(sets: int, dtype=torch.float64, per_example: bool = False):
    """Stationary (``sets = 1``, per-head points) or non-stationary stacked points (MIKAN's layout,
    per example and head when ``per_example``), requiring grad."""
    shape = (B, H, sets * R, D) if per_example else (H, sets * R, D)
    w = (rand(*shape, seed=20 + sets, grad=False) * 0.7).to(dtype).requires_grad_()
    return (RandomFourier(w) if sets == 1 else NonStationaryFourier.stacked(w)), w


def _mask(kind: str):
    if kind == "key_padding":  # batch 1 keeps its first 9 keys
        m = torch.ones(B, 1, 1, NK, dtype=torch.bool)
        m[1, ..., 9:] = False
        return m.to(DEVICE)
    if kind == "full":  # a fully masked query row (3) and a key no query sees (4)
        g = torch.Generator().manual_seed(5)
        m = torch.randn(NQ, NK, generator=g, dtype=torch.float64)
        m[torch.rand(NQ, NK, generator=g) < 0.3] = float("-inf")
        m[3, :] = float("-inf")
        m[:, 4] = float("-inf")
        return m.to(DEVICE)
    return None


@pytest.mark.parametrize(("sets", "p", "kind", "causal"), [
    (1, 1.0, "key_padding", False),   # IKAN, stationary points per head
    (2, 1.5, "full", False),          # MIKAN / IKAN non-stationary, general p, fully masked row
    (2, 2.0, "key_padding", True),    # IKA-NS, causal with padding
    (1, None, "none", True),          # no magnitude (RBF-only style)
])
def test_fused_fourier_matches_float64_reference(sets, p, kind, causal):
    q, k, v = rand(B, H, NQ, D, seed=1), rand(B, H, NK, D, seed=2), rand(B, H, NK, DV, seed=3)
    kernel, w = _kernel(sets, per_example=sets == 2)
    kw = dict(kernel=kernel, magnitude_p=p, attn_mask=_mask(kind), is_causal=causal)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, **kw)
    assert dispatch.last_dispatch["kernel"] == "triton"
    ref = kernel_weights(q, k, **kw) @ v
    assert_close(out, ref, 1e-12, what="out")
    if kind == "full":
        assert out[:, :, 3].abs().max() == 0  # the reference's convention: a fully masked row is 0
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q, k, v, w)))):
        assert_close(got, want, 1e-10, rtol=1e-10, what="dq dk dv dW".split()[i])


def test_fused_fourier_float16_against_float64():
    """float16 inputs (features and accumulation in float32) compared in float32."""
    q, k, v = (rand(B, H, n, dd, seed=s, grad=False).half().requires_grad_()
               for n, dd, s in ((NQ, D, 1), (NK, D, 2), (NK, DV, 3)))
    kernel, w = _kernel(2)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, kernel=kernel, magnitude_p=1.0, attn_mask=_mask("key_padding"))
    assert out.dtype == torch.float16 and dispatch.last_dispatch["kernel"] == "triton"
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = kernel_weights(q64, k64, kernel=kernel, magnitude_p=1.0, attn_mask=_mask("key_padding")) @ v64
    assert_close(out.float(), ref, 5e-3, what="out")
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q64, k64, v64, w)))):
        rel = (got.double() - want).norm() / want.norm()
        assert torch.isfinite(got).all() and rel < 1e-2, f"{'dq dk dv dW'.split()[i]}: {rel:.2e}"


@pytest.mark.slow
def test_fused_fourier_gradcheck():
    """torch.autograd.gradcheck of the Triton op itself (float64, tiny sizes, one partial block);
    ~30 s in the interpreter: ``pytest -m slow tests/functional/triton/test_fourier.py``."""
    from attnopt.functional.triton._fourier import ika_attention

    q, k, v = rand(1, 1, 5, 3, seed=7), rand(1, 1, 6, 3, seed=8), rand(1, 1, 6, 2, seed=9)
    w = rand(1, 1, 8, 3, seed=10)
    cb = torch.zeros(1, 1, 6, dtype=torch.float64, device=DEVICE)
    cb[..., 2] = -0.3
    cb.requires_grad_()

    def fn(q, k, v, w, cb):
        return ika_attention(q, k, v, w, cb, None, causal=True, magnitude_p=1.5, scale=0.4, eps=1e-3,
                             coef=0.5, sets=2)[0]
    with blocks():
        assert torch.autograd.gradcheck(fn, (q, k, v, w, cb), atol=1e-7)


@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_module_under_triton_matches_reference_backend(variant):
    """The IKAN / MIKAN modules' forward and parameter gradients (density networks, copula) with
    the Triton kernel equal those of the plain-PyTorch reference (same fixed eval noise)."""
    torch.manual_seed(0)
    mod = ImplicitKernelAttention(16, 2, variant, num_samples=8, p=1.5, seed=3).double().to(DEVICE).eval()
    x = rand(2, 11, 16, seed=4)
    pad = torch.zeros(2, 11, dtype=torch.bool, device=DEVICE)
    pad[1, 7:] = True
    outs, gs = [], []
    for name in ("triton", "reference"):
        with blocks(), attnopt.backend(name):
            out = mod(x, x, x, key_padding_mask=pad)[0]
        assert dispatch.last_dispatch["kernel"] == name
        outs.append(out)
        gs.append(grads(out, (x, *mod.parameters())))
    assert_close(outs[0], outs[1], 1e-12, what="out")
    for i, (a, b) in enumerate(zip(*gs)):
        assert_close(a, b, 1e-10, rtol=1e-10, what=f"grad {i}")


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 20), dv=st.integers(1, 20),
       r=st.integers(1, 20), sets=st.sampled_from([1, 2]), p=st.sampled_from([None, 1.0, 1.25, 2.0, 3.0]),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_fourier_any_shape(nq, nk, d, dv, r, sets, p, causal, seed):
    """Any sizes (block remainders, d / dv / R not powers of two, one row, one key): values and
    gradients against float64; ~1–2 s an example in the interpreter (``pytest -m slow``)."""
    q, k = rand(1, 2, nq, d, seed=seed), rand(1, 2, nk, d, seed=seed + 1)
    v = rand(1, 2, nk, dv, seed=seed + 2)
    w = rand(2, sets * r, d, seed=seed + 3)
    kernel = RandomFourier(w) if sets == 1 else NonStationaryFourier.stacked(w)
    kw = dict(kernel=kernel, magnitude_p=p, is_causal=causal)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, **kw)
    ref = kernel_weights(q, k, **kw) @ v
    assert_close(out, ref, 1e-11, what="out")
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q, k, v, w)))):
        assert_close(got, want, 1e-9, rtol=1e-9, what="dq dk dv dW".split()[i])
