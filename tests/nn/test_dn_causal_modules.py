"""DNAS / Sinkhorn / HNAS modules and registry arms in a causal decoder: no position reads a later one.

``module(x, is_causal=True)`` runs the autoregressive ``causal="prefix"`` variant by default; the
constructor option ``causal="plan"`` keeps the masked plan (which leaks, checked here as well).
"""
from __future__ import annotations

import pytest
import torch

from attnopt.nn import HybridNormalizedMultiheadAttention, make_attention
from tests.reference.dn_prefix import prefix_hybrid_ref

ARMS = [("dnas", {}), ("sinkhorn", {}), ("hnas", {}), ("hnas", {"per_head": True})]


def _x(n=7, seed=0):
    return torch.randn(2, n, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize(("name", "opts"), ARMS)
def test_registry_arm_is_autoregressive_under_is_causal(name, opts):
    torch.manual_seed(0)
    mod = make_attention(name, 16, 4, **opts).double()
    plan = make_attention(name, 16, 4, causal="plan", **opts).double()
    plan.load_state_dict(mod.state_dict())
    x = _x()
    for t in (2, 5):
        x2 = x.clone()
        x2[:, t:] = torch.randn(x2[:, t:].shape, dtype=torch.float64)
        a, _ = mod(x, is_causal=True)
        b, _ = mod(x2, is_causal=True)
        assert torch.equal(a[:, :t], b[:, :t])
        pa, _ = plan(x, is_causal=True)
        pb, _ = plan(x2, is_causal=True)
        assert (pa[:, :t] - pb[:, :t]).abs().max() > 1e-6  # the masked plan reads later queries
    # the prefix variant asked for by name equals the default under is_causal, also with an explicit
    # causal attn_mask (a mask is never inspected: the name is what selects the variant)
    named = make_attention(name, 16, 4, causal="prefix", **opts).double()
    named.load_state_dict(mod.state_dict())
    causal_mask = torch.ones(7, 7, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = not allowed
    torch.testing.assert_close(named(x, attn_mask=causal_mask)[0], mod(x, is_causal=True)[0],
                               rtol=1e-12, atol=1e-12)
    # without a causal mask the module is unchanged (encoders)
    torch.testing.assert_close(mod(x)[0], plan(x)[0], rtol=0, atol=0)


def test_hnas_module_prefix_matches_the_oracle_with_padding():
    torch.manual_seed(1)
    mod = HybridNormalizedMultiheadAttention(8, 2, iterations=2, init_weight=0.3).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    out, w = mod(x, key_padding_mask=pad, is_causal=True, need_weights=True, average_attn_weights=False)

    def split(t):
        return t.view(2, 5, 2, 4).transpose(1, 2)

    q, k, v = split(mod.q_proj(x)), split(mod.k_proj(x)), split(mod.v_proj(x))
    o = prefix_hybrid_ref(q, k, v, torch.sigmoid(mod.weight_logit), 2, mask=(~pad).view(2, 1, 1, 5))
    torch.testing.assert_close(out, mod.out_proj(o.transpose(1, 2).reshape(2, 5, 8)))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))
    out.sum().backward()
    assert mod.weight_logit.grad is not None and torch.isfinite(mod.weight_logit.grad)


def test_bad_causal_option_is_refused_by_module_and_registry():
    with pytest.raises(ValueError, match="causal must be"):
        make_attention("dnas", 8, 2, causal="strict")
    with pytest.raises(ValueError, match="causal must be"):
        HybridNormalizedMultiheadAttention(8, 2, causal=True)  # type: ignore[arg-type]
    assert "causal='plan'" in repr(make_attention("sinkhorn", 8, 2, causal="plan"))
