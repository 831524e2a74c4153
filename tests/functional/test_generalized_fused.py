"""The two fused generalized-attention paths (chunked materialized, CPU flash with subnormals
flushed) against the float64 reference: values, gradients incl. the bias gradient, every bias
broadcast shape across several cache chunks, masks, causal, rows with no admissible key."""
from __future__ import annotations

import pytest
import torch

from attnopt.functional import dispatch
from attnopt.functional._denormal import flush_denormal, flush_denormal_on
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized import generalized_attention
from attnopt.nn.preference import ALiBiPreference
from tests.reference.generalized import generalized_attention_ref


def _qkv(b, h, nq, nk, d=4, dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=torch.float64).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


def _ref(q, k, v, bias, is_causal=False):
    """softmax(scale q kᵀ + bias) v in float64 (the reference takes the bias as ``attn_mask``)."""
    return generalized_attention_ref(q, k, v, attn_mask=bias, is_causal=is_causal)


@pytest.mark.parametrize("bias_shape", [(1, 3, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (2, 3, 1, 7), (1, 1, 5, 1)])
@pytest.mark.parametrize("chunk_bytes", [1, 5 * 7 * 8 * 2, 1 << 20])  # one head, two heads, everything
@pytest.mark.parametrize("save_bytes", [1 << 40, 0], ids=["P-saved", "P-recomputed"])
def test_materialized_chunks_match_reference_with_bias_gradient(
    monkeypatch, native_or_torch, bias_shape, chunk_bytes, save_bytes
):
    monkeypatch.setattr(THRESHOLDS, "generalized_chunk_bytes", chunk_bytes)
    monkeypatch.setattr(THRESHOLDS, "generalized_cpu_chunk_bytes", chunk_bytes)
    monkeypatch.setattr(THRESHOLDS, "generalized_save_bytes", save_bytes)
    # auto: SDPA itself at these tiny sizes otherwise
    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below", 0)
    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below_learned_native", 0)
    q, k, v = _qkv(2, 3, 5, 7)
    bias = torch.randn(bias_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if bias_shape[-2] > 1:
        bias[..., 1, :] = float("-inf")  # a row with no admissible key
    bias.requires_grad_()
    out = generalized_attention(q, k, v, log_preference=bias, is_causal=True)
    assert dispatch.last_dispatch["generalized"] == "materialized"
    ref = _ref(q, k, v, bias, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    leaves = (q, k, v, bias)
    for a, r in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("save_bytes", [1 << 40, 0], ids=["P-saved", "P-recomputed"])
def test_materialized_chunks_gradcheck(monkeypatch, native_or_torch, save_bytes):
    monkeypatch.setattr(THRESHOLDS, "generalized_chunk_bytes", 1)
    monkeypatch.setattr(THRESHOLDS, "generalized_cpu_chunk_bytes", 1)
    monkeypatch.setattr(THRESHOLDS, "generalized_save_bytes", save_bytes)
    q, k, v = _qkv(2, 2, 3, 4, seed=2)
    bias = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: generalized_attention(q, k, v, log_preference=b, impl="materialized"),
        (q, k, v, bias))


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_flash_path_matches_reference_under_alibi_and_masks(mask_kind):
    q, k, v = _qkv(2, 4, 9, 11, seed=3)
    alibi = ALiBiPreference(4, slopes=torch.tensor([40.0, 4.0, 0.5, 0.0], dtype=torch.float64))
    log_u = alibi(9, 11)  # slope 40: weights far below float64's smallest normal beyond a few keys
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(2, 1, 9, 11, generator=g) > 0.3
    keep[0, 0, 2] = False  # a row with no admissible key
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    mask = keep if mask_kind == "bool" else additive
    out = generalized_attention(q, k, v, log_preference=log_u, attn_mask=mask, impl="streaming")
    assert dispatch.last_dispatch["generalized"] == "streaming"
    ref = generalized_attention_ref(q, k, v, attn_mask=log_u + torch.where(keep, 0.0, float("-inf")))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def test_flash_path_float32_matches_sdpa_with_the_same_bias():
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(1, 8, 64, 64, d=8, dv=8, seed=5))
    bias = ALiBiPreference(8).log_preference(torch.zeros(1, 64, 8), torch.zeros(1, 64, 8))
    out = generalized_attention(q, k, v, log_preference=bias, is_causal=True, impl="streaming")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias + torch.full((64, 64), float("-inf")).triu(1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_flush_denormal_restores_the_previous_mode():
    assert not flush_denormal_on()
    with flush_denormal():
        assert flush_denormal_on()
        assert torch.tensor(1e-40, dtype=torch.float32).item() == 0.0
    assert not flush_denormal_on()
    torch.set_flush_denormal(True)
    try:
        with flush_denormal():
            assert flush_denormal_on()
        assert flush_denormal_on()  # a mode the caller set stays set
    finally:
        torch.set_flush_denormal(False)
    with pytest.raises(RuntimeError), flush_denormal():
        raise RuntimeError("boom")
    assert not flush_denormal_on()


def test_alibi_bias_cache_is_rebuilt_after_inplace_changes():
    alibi = ALiBiPreference(2)
    a = alibi(3, 4)
    assert alibi(3, 4) is a and a.is_contiguous()
    a.zero_()  # a caller wrote into the shared tensor: the next call builds it anew
    b = alibi(3, 4)
    assert b is not a and b[0, 0, 0, 1] == -alibi.slopes[0]
    alibi.slopes.mul_(2)  # new slopes: new bias
    assert torch.equal(alibi(3, 4)[0, :, 0, 1], -alibi.slopes)
    assert alibi(3, 4).dtype == alibi.slopes.dtype
    query = torch.zeros(1, 3, 2, dtype=torch.float64)
    assert alibi.log_preference(query, torch.zeros(1, 4, 2)).dtype == torch.float64
