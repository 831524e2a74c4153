"""Sparsemax / α-entmax attention Triton kernels against the float64 reference (values, gradients).

Forced with ``attnopt.backend("triton")`` through ``regularized_attention``; without CUDA in
Triton's interpreter on CPU tensors (``_helpers``). Sizes are not multiples of the 16 × 16 blocks.
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.regularized import regularized_attention, regularized_attention_weights
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from tests.functional.triton._helpers import DEVICE, assert_close, blocks, grads, rand

B, H, NQ, NK, D, DV = 1, 2, 21, 27, 10, 6


def _mask(kind: str):
    if kind == "key_padding":
        m = torch.ones(NK, dtype=torch.bool)
        m[[2, 3, 19]] = False
        return m.to(DEVICE)
    if kind == "full":  # float mask with a fully masked row (query 5)
        g = torch.Generator().manual_seed(3)
        m = torch.randn(NQ, NK, generator=g, dtype=torch.float64)
        m[torch.rand(NQ, NK, generator=g) < 0.3] = float("-inf")
        m[5] = float("-inf")
        return m.to(DEVICE)
    return None


@pytest.mark.parametrize(("reg", "kind"), [
    (SquaredL2(), "none"), (SquaredL2(), "full"), (Tsallis(1.5), "key_padding"), (Tsallis(1.5), "causal"),
    (Tsallis(1.25), "full"), (Tsallis(3.0), "none"),
])
def test_entmax_attention_matches_float64_reference(reg, kind):
    q, k, v = rand(B, H, NQ, D, seed=1), rand(B, H, NK, D, seed=2), rand(B, H, NK, DV, seed=3)
    q = (3 * q).detach().requires_grad_()  # peaked scores: sparse rows, all-zero tiles skipped
    mask, causal = _mask(kind), kind == "causal"
    with blocks(), attnopt.backend("triton"):
        out = regularized_attention(q, k, v, regularizer=reg, attn_mask=mask, is_causal=causal)
    assert dispatch.last_dispatch["sparse"] == "triton"
    w = regularized_attention_weights(q, k, regularizer=reg, attn_mask=mask, is_causal=causal)
    assert (w == 0).float().mean() > 0.3  # the test exercises sparsity
    ref = w @ v
    assert_close(out, ref, 1e-11, what="out")
    for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_close(got, want, 1e-10, what=f"d{name}")


def test_entmax15_half_precision_is_close_and_finite():
    q, k, v = rand(B, H, NQ, D, seed=4), rand(B, H, NK, D, seed=5), rand(B, H, NK, DV, seed=6)
    ref = regularized_attention_weights(q, k, regularizer=Tsallis(1.5)) @ v
    qh, kh, vh = (x.detach().half().requires_grad_() for x in (q, k, v))
    with blocks(), attnopt.backend("triton"):
        out = regularized_attention(qh, kh, vh, regularizer=Tsallis(1.5))
    assert out.dtype == torch.float16
    assert_close(out, ref, 5e-3, what="out")
    for got, want, name in zip(grads(out, (qh, kh, vh)), grads(ref, (q, k, v)), "qkv"):
        assert_close(got, want, 2e-2, rtol=1e-2, what=f"d{name}")
