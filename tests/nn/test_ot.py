"""OTAttention: learned-query OT pooling (OT-ViT's last layer)."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt import ot_attention
from attnopt.nn import OTAttention
from tests.reference.ot import cost_matrix, ot_weights_reference

F64 = torch.float64


def _module(**kw):
    torch.manual_seed(0)
    return OTAttention(8, 2, **kw).double()


def _tokens(b=2, n=5, e=8, seed=1):
    return torch.randn(b, n, e, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_matches_manual_projection_and_reference():
    mod = _module()
    x = _tokens()
    out, w = mod(x, need_weights=True)
    assert out.shape == (2, 8) and w.shape == (2, 2, 5)
    assert mod.gamma == math.sqrt(8) and mod.alpha == 1.0
    z = mod.split_heads(mod.q_proj(mod.query.expand(2, 1, 8)))
    t = mod.split_heads(mod.k_proj(x))
    v = mod.split_heads(mod.v_proj(x))
    u = torch.full((2, 2, 5), 0.2, dtype=F64)
    ref_w = ot_weights_reference(z, t, t, u, cost_matrix(t, t, "neg_dot"), 1.0, math.sqrt(8))
    torch.testing.assert_close(w, ref_w.squeeze(-2))
    expected = mod.out_proj(mod.merge_heads(ref_w @ v)).squeeze(1)
    torch.testing.assert_close(out, expected)


def test_extra_bank_receives_mass_and_padding_is_excluded():
    mod = _module(gamma=0.5)
    x, extra = _tokens(), _tokens(n=3, seed=2)
    kpm = torch.tensor([[False, False, False, True, True], [False] * 5])
    bpm = torch.tensor([[False, True, False], [False, False, False]])
    out, w = mod(x, bank=extra, key_padding_mask=kpm, bank_padding_mask=bpm, need_weights=True)
    assert w.shape == (2, 2, 8)
    assert torch.all(w[0, :, 3:5] == 0) and torch.all(w[0, :, 6] == 0)
    assert torch.all(w[:, :, 5:][:, :, [0, 2]] > 0)  # bank members outside the input get weight
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, dtype=F64))
    # padding = truncation: the unpadded first example alone gives the same output
    out0, _ = mod(x[:1, :3], bank=extra[:1, [0, 2]])
    torch.testing.assert_close(out[:1], out0)


def test_gradients_flow_to_all_parameters_and_bank():
    mod = _module(cost="sqeuclidean")
    x, extra = _tokens().requires_grad_(), _tokens(n=3, seed=2).requires_grad_()
    out, _ = mod(x, bank=extra)
    out.square().sum().backward()
    for name, p in mod.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert mod.query.grad.abs().sum() > 0 and extra.grad.abs().sum() > 0


def test_callable_cost_and_float32():
    mod = OTAttention(8, 2, cost=lambda a, t: cost_matrix(a, t, "sqeuclidean"))
    x = _tokens().float()
    out, _ = mod(x)
    ref_mod = OTAttention(8, 2, cost="sqeuclidean")
    ref_mod.load_state_dict(mod.state_dict())
    torch.testing.assert_close(out, ref_mod(x)[0])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_functional_equivalence_gamma_given():
    mod = _module(alpha=0.5, gamma=2.0)
    x = _tokens()
    z = mod.split_heads(mod.q_proj(mod.query.expand(2, 1, 8)))
    t, v = mod.split_heads(mod.k_proj(x)), mod.split_heads(mod.v_proj(x))
    heads = ot_attention(z, t, bank_values=v, alpha=0.5, gamma=2.0)
    expected = mod.out_proj(mod.merge_heads(heads)).squeeze(1)
    torch.testing.assert_close(mod(x)[0], expected)


@pytest.mark.parametrize(
    "kw,exc",
    [(dict(alpha=0.0), ValueError), (dict(gamma=-1.0), ValueError), (dict(cost="l1"), ValueError),
     (dict(cost=torch.ones(2, 2)), TypeError)],
)
def test_bad_construction(kw, exc):
    with pytest.raises(exc):
        OTAttention(8, 2, **kw)
    with pytest.raises(ValueError):
        OTAttention(8, 3)


def test_bad_calls():
    mod = _module()
    x = _tokens()
    with pytest.raises(ValueError, match="tokens"):
        mod(x[0])
    with pytest.raises(ValueError, match="bank"):
        mod(x, bank=_tokens(b=1))
    with pytest.raises(TypeError, match="key_padding_mask"):
        mod(x, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mod(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="without a bank"):
        mod(x, bank_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
