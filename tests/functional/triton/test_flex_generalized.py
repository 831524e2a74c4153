"""Generalized attention through FlexAttention: forward against the float64 reference on any device
(CPU: PyTorch's eager Flex, forward only), gradients to the bias tables on CUDA (``-m gpu``)."""
from __future__ import annotations

import copy

import pytest
import torch

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.generalized import generalized_attention, generalized_weights
from attnopt.nn.preference import ALiBiPreference, T5RelativePreference
from tests.functional.triton._helpers import DEVICE, assert_close, needs_cuda, rand

B, H, NQ, NK, D = 2, 2, 21, 27, 16


def _case(kind: str, dtype=torch.float64):
    """(kwargs of generalized_attention, parameters that should get a gradient)."""
    if kind == "t5":
        mod = T5RelativePreference(H).to(DEVICE, dtype)
        return dict(log_preference=mod(NQ, NK)), list(mod.parameters())
    if kind == "alibi":
        return dict(log_preference=ALiBiPreference(H).to(DEVICE, dtype)(NQ, NK)), []
    if kind == "key_preference":  # a learned key preference (B, H, 1, Nk) and key padding
        lp = rand(B, H, 1, NK, dtype=dtype, seed=9)
        m = torch.ones(B, 1, 1, NK, dtype=torch.bool, device=DEVICE)
        m[1, ..., 5:] = False
        return dict(log_preference=lp, attn_mask=m), [lp]
    if kind == "t5_padding":  # relative offsets and a key-padding mask, a fully padded batch
        mod = T5RelativePreference(H).to(DEVICE, dtype)
        m = torch.ones(B, 1, 1, NK, dtype=torch.bool, device=DEVICE)
        m[0] = False
        return dict(log_preference=mod(NQ, NK), attn_mask=m), list(mod.parameters())
    u = torch.rand(NQ, NK, dtype=dtype, device=DEVICE)  # a full preference with zeros
    u[u < 0.2] = 0
    return dict(preference=u), []


@pytest.mark.parametrize(("kind", "causal"), [
    ("t5", False), ("t5", True), ("alibi", True), ("key_preference", False), ("t5_padding", False),
    ("full_preference", True),
])
def test_flex_forward_matches_reference(kind, causal):
    q, k, v = (rand(B, H, n, D, seed=s, grad=False) for n, s in ((NQ, 1), (NK, 2), (NK, 3)))
    kwargs, _ = _case(kind)
    with attnopt.backend("triton"):
        out = generalized_attention(q, k, v, is_causal=causal, **kwargs)
    assert dispatch.last_dispatch["generalized"] == "triton"
    ref = generalized_weights(q, k, is_causal=causal, **kwargs) @ v
    assert_close(out, ref, 1e-12, what="out")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["t5", "key_preference"])
def test_flex_bf16_gradients_reach_the_bias_tables(kind):
    """bf16 on CUDA, N = 256, causal: output within 2e-2 of float64 and the table / preference
    gradients within 5e-2 relative (bf16 has an 8-bit mantissa: ~4e-3 per rounding)."""
    torch.manual_seed(0)
    n, bf = 256, torch.bfloat16
    q, k, v = (torch.randn(B, H, n, 64, device=DEVICE) for _ in range(3))
    if kind == "t5":
        mod = T5RelativePreference(H).to(DEVICE)
        mod64 = copy.deepcopy(mod).double()
        lp, lp64 = mod(n, n), mod64(n, n)  # float32 offsets, read through the score_mod
        params, params64 = list(mod.parameters()), list(mod64.parameters())
    else:
        lp = torch.randn(B, H, 1, n, device=DEVICE, requires_grad=True)
        lp64 = lp.detach().double().requires_grad_()
        params, params64 = [lp], [lp64]
        lp = lp.to(bf)
    with attnopt.backend("triton"):
        out = generalized_attention(q.to(bf), k.to(bf), v.to(bf), log_preference=lp, is_causal=True)
    assert dispatch.last_dispatch["generalized"] == "triton"
    g = torch.autograd.grad(out.float().square().sum(), params)
    ref = generalized_weights(q.double(), k.double(), log_preference=lp64, is_causal=True) @ v.double()
    g64 = torch.autograd.grad(ref.square().sum(), params64)
    assert (out.double() - ref).abs().max() < 2e-2
    for a, b in zip(g, g64):
        assert (a.double() - b).norm() / b.norm() < 5e-2
