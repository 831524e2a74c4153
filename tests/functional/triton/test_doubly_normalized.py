"""DNAS, Sinkhorn-K and HNAS Triton kernels against the float64 reference (values and gradients).

Forced with ``attnopt.backend("triton")``; on a machine without CUDA they run in Triton's
interpreter on CPU tensors (see ``_helpers``). Sizes are not multiples of the 16 × 16 blocks.
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
from tests.functional.triton._helpers import DEVICE, assert_close, blocks, grads, rand

B, H, NQ, NK, D, DV = 2, 2, 21, 27, 10, 6


def _mask(kind: str):
    g = torch.Generator().manual_seed(5)
    if kind == "none" or kind == "causal":
        return None
    if kind == "key_padding":  # batch 1 keeps only its first 9 keys
        m = torch.ones(B, 1, 1, NK, dtype=torch.bool)
        m[1, ..., 9:] = False
        return m.to(DEVICE)
    if kind == "query_padding":  # (B, 1, Nq, 1): padded queries see nothing; never an Nq x Nk tensor
        m = torch.ones(B, 1, NQ, 1, dtype=torch.bool)
        m[0, :, 15:] = False
        return m.to(DEVICE)
    # full float mask with a fully masked row (query 3) and a key no query sees (key 4)
    m = torch.randn(NQ, NK, generator=g, dtype=torch.float64)
    m[torch.rand(NQ, NK, generator=g) < 0.3] = float("-inf")
    m[3, :] = float("-inf")
    m[:, 4] = float("-inf")
    return m.to(DEVICE)


@pytest.mark.parametrize("kind", ["none", "key_padding", "query_padding", "full", "causal"])
def test_dnas_matches_float64_reference(kind):
    q, k, v = rand(B, H, NQ, D, seed=1), rand(B, H, NK, D, seed=2), rand(B, H, NK, DV, seed=3)
    # causal: the kernels' variant is causal="plan" (the mask restricts the plan; is_causal alone
    # means the autoregressive "prefix" variant, which has no Triton kernel)
    mask, causal = _mask(kind), kind == "causal"
    with blocks(), attnopt.backend("triton"):
        out = doubly_normalized_attention(q, k, v, attn_mask=mask, is_causal=causal, causal="plan")
    assert dispatch.last_dispatch["doubly_normalized"] == "triton"
    ref = doubly_normalized_weights(q, k, attn_mask=mask, is_causal=causal, causal="plan") @ v
    assert_close(out, ref, 1e-12, what="out")
    for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_close(got, want, 1e-11, what=f"d{name}")


def test_sinkhorn_k3_with_key_padding_and_causal():
    q, k, v = rand(1, H, NQ, D, seed=4), rand(1, H, NK, D, seed=5), rand(1, H, NK, DV, seed=6)
    mask = torch.ones(NK, dtype=torch.bool, device=DEVICE)
    mask[[0, 7, 20]] = False
    with blocks(), attnopt.backend("triton"):
        out = doubly_normalized_attention(q, k, v, iterations=3, attn_mask=mask, is_causal=True,
                                          causal="plan")
    assert dispatch.last_dispatch["sinkhorn"] == "triton"
    ref = doubly_normalized_weights(q, k, iterations=3, attn_mask=mask, is_causal=True, causal="plan") @ v
    assert_close(out, ref, 1e-12, what="out")
    for got, want, name in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_close(got, want, 1e-11, what=f"d{name}")


def test_hnas_per_head_weight_and_its_gradient():
    q, k, v = rand(B, H, NQ, D, seed=7), rand(B, H, NK, D, seed=8), rand(B, H, NK, DV, seed=9)
    w = torch.tensor([0.25, 0.8], dtype=torch.float64, device=DEVICE, requires_grad=True)
    mask = _mask("key_padding")
    with blocks(), attnopt.backend("triton"):
        out = hybrid_normalized_attention(q, k, v, w, attn_mask=mask)
    assert dispatch.last_dispatch["hybrid_normalized"] == "triton"
    ref = hybrid_normalized_weights(q, k, w, attn_mask=mask) @ v
    assert_close(out, ref, 1e-12, what="out")
    for got, want, name in zip(grads(out, (q, k, v, w)), grads(ref, (q, k, v, w)), ["q", "k", "v", "w"]):
        assert_close(got, want, 1e-11, what=f"d{name}")


def test_dnas_half_precision_error_is_bounded_and_finite():
    """float16 (bf16 ``tl.dot`` is unusable in the interpreter): error vs float64 within a few
    multiples of float16's own rounding of the reference output, and never NaN."""
    q, k, v = rand(B, H, NQ, D, seed=10), rand(B, H, NK, D, seed=11), rand(B, H, NK, DV, seed=12)
    ref = doubly_normalized_weights(q, k) @ v
    qh, kh, vh = (x.detach().half().requires_grad_() for x in (q, k, v))
    with blocks(), attnopt.backend("triton"):
        out = doubly_normalized_attention(qh, kh, vh)
    assert out.dtype == torch.float16
    assert_close(out, ref, 4e-3, what="out")
    for got, want, name in zip(grads(out, (qh, kh, vh)), grads(ref, (q, k, v)), "qkv"):
        assert_close(got, want, 2e-2, rtol=1e-2, what=f"d{name}")


def test_layouts_3d_inputs_one_query_and_broadcast_keys():
    """Strided views are read as they are: a transposed q, keys shared by every head (stride 0),
    3-D inputs, and a single query; all against the reference."""
    base = rand(H, D, 1, seed=13, grad=False)  # (H, D, 1) -> q (H, 1, D) as a transposed view
    q = base.transpose(-1, -2).requires_grad_()
    k = rand(1, NK, D, seed=14)  # one set of keys for every head
    v = rand(H, NK, DV, seed=15)
    with blocks(), attnopt.backend("triton"):
        out = doubly_normalized_attention(q, k, v)
    ref = doubly_normalized_weights(q, k) @ v
    assert out.shape == (H, 1, DV)
    assert_close(out, ref, 1e-12, what="out")
    for got, want, name in zip(grads(out, (k, v)), grads(ref, (k, v)), "kv"):
        assert_close(got, want, 1e-11, what=f"d{name}")
