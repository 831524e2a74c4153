"""DoublyNormalized/HybridNormalizedMultiheadAttention: projections, masks, weights, learned w."""
from __future__ import annotations

import pytest
import torch

from attnopt.functional import doubly_normalized_attention
from attnopt.nn import DoublyNormalizedMultiheadAttention, HybridNormalizedMultiheadAttention
from tests.reference.dn_prefix import prefix_attention_ref, prefix_hybrid_ref
from tests.reference.doubly_normalized import attention_ref, hybrid_ref


def _manual(mod, x, iterations, mask=None, causal=False, weight=None, prefix=False):
    b, n, e = x.shape
    h = mod.num_heads

    def split(t):
        return t.view(b, n, h, e // h).transpose(1, 2)

    q, k, v = split(mod.q_proj(x)), split(mod.k_proj(x)), split(mod.v_proj(x))
    if prefix:
        o = (prefix_attention_ref(q, k, v, iterations, mask=mask, is_causal=causal) if weight is None else
             prefix_hybrid_ref(q, k, v, weight, iterations, mask=mask, is_causal=causal))
    elif weight is None:
        o = attention_ref(q, k, v, iterations, mask=mask, is_causal=causal)
    else:
        o = hybrid_ref(q, k, v, weight, iterations, mask=mask, is_causal=causal)
    return mod.out_proj(o.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("causal", [None, "prefix", "plan"])
def test_dnas_module_matches_manual_with_padding_and_causal(causal):
    """is_causal=True runs the autoregressive prefix variant unless the module was built with "plan"."""
    torch.manual_seed(0)
    mod = DoublyNormalizedMultiheadAttention(8, 2, iterations=2, causal=causal).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    out, w = mod(x, key_padding_mask=pad, need_weights=True, average_attn_weights=False, is_causal=True)
    keep = (~pad).view(3, 1, 1, 5)
    torch.testing.assert_close(out, _manual(mod, x, 2, keep, True, prefix=causal != "plan"))
    assert w.shape == (3, 2, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 5, dtype=torch.float64))
    assert torch.equal(w[1, ..., 3:], torch.zeros_like(w[1, ..., 3:]))
    out2, none = mod(x, key_padding_mask=pad, is_causal=True)
    assert none is None
    torch.testing.assert_close(out, out2)


def test_hybrid_module_learned_weight_moves_and_is_exposed():
    torch.manual_seed(1)
    mod = HybridNormalizedMultiheadAttention(8, 2, init_weight=0.3).double()
    assert abs(float(mod.mixing_weight) - 0.3) < 1e-6
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    out, w = mod(x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, _manual(mod, x, 1, weight=torch.sigmoid(mod.weight_logit)))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4, dtype=torch.float64))
    out.pow(2).sum().backward()
    assert mod.weight_logit.grad is not None and mod.weight_logit.grad.abs() > 0
    per_head = HybridNormalizedMultiheadAttention(8, 2, per_head=True)
    assert per_head.mixing_weight.shape == (2,)
    o, _ = per_head(torch.randn(2, 4, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool).triu(1))
    assert torch.isfinite(o).all()


def test_iterations_zero_module_is_softmax_attention_and_cross_attention():
    torch.manual_seed(2)
    mod = DoublyNormalizedMultiheadAttention(8, 2, iterations=0, kdim=6, vdim=5).double()
    x, kv, vv = (torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 7, 6, dtype=torch.float64),
                 torch.randn(2, 7, 5, dtype=torch.float64))
    out, _ = mod(x, kv, vv)
    q = mod.q_proj(x).view(2, 3, 2, 4).transpose(1, 2)
    k = mod.k_proj(kv).view(2, 7, 2, 4).transpose(1, 2)
    v = mod.v_proj(vv).view(2, 7, 2, 4).transpose(1, 2)
    att = torch.softmax(q @ k.transpose(-1, -2) / 2, -1).matmul(v)
    ref = mod.out_proj(att.transpose(1, 2).reshape(2, 3, 8))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(doubly_normalized_attention(q, k, v, iterations=0),
                               torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v)


def test_module_bad_arguments():
    with pytest.raises(ValueError):
        DoublyNormalizedMultiheadAttention(8, 2, iterations=-1)
    with pytest.raises(ValueError):
        HybridNormalizedMultiheadAttention(8, 2, iterations=0)
    with pytest.raises(ValueError):
        HybridNormalizedMultiheadAttention(8, 2, init_weight=1.0)
    with pytest.raises(ValueError):
        DoublyNormalizedMultiheadAttention(8, 3)
