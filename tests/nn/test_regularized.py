"""Tests of attnopt.nn.RegularizedMultiheadAttention."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from attnopt.functional import Shannon, SquaredL2, Tsallis, regularized_attention_weights
from attnopt.nn import ALiBiPreference, GeneralizedMultiheadAttention, RegularizedMultiheadAttention


def _x(b=2, n=5, e=8, seed=0):
    return torch.randn(b, n, e, generator=torch.Generator().manual_seed(seed))


def test_shannon_matches_torch_multihead_attention():
    torch.manual_seed(0)
    ours = RegularizedMultiheadAttention(8, 2)
    ref = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = _x()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, -2:] = True
    out, w = ours(x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    out_ref, w_ref = ref(x, x, x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)


def test_alibi_locality_matches_generalized_with_alibi_preference():
    torch.manual_seed(1)
    alibi = ALiBiPreference(2)
    ours = RegularizedMultiheadAttention(8, 2, locality=alibi.slopes)
    gen = GeneralizedMultiheadAttention(8, 2, preference=alibi)
    gen.load_state_dict(ours.state_dict(), strict=False)
    x = _x(seed=1)
    out, w = ours(x, need_weights=True, average_attn_weights=False)
    out_g, w_g = gen(x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, out_g, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, w_g, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.3)], ids=repr)
def test_sparse_module_weights_and_output_consistent(reg):
    torch.manual_seed(2)
    m = RegularizedMultiheadAttention(8, 2, regularizer=reg, locality=0.3)
    x = _x(seed=2)
    out, w = m(x, need_weights=True, average_attn_weights=False, is_causal=True)
    assert w is not None and w.shape == (2, 2, 5, 5)
    assert (w == 0).any()
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 5), atol=1e-5)
    assert (w.triu(1) == 0).all()
    q = m.split_heads(m.q_proj(x))
    k = m.split_heads(m.k_proj(x))
    v = m.split_heads(m.v_proj(x))
    w_ref = regularized_attention_weights(q, k, regularizer=reg, locality=0.3, is_causal=True)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(out, m.out_proj(m.merge_heads(w_ref @ v)), atol=1e-5, rtol=1e-5)


def test_learned_locality_receives_gradient():
    m = RegularizedMultiheadAttention(8, 2, SquaredL2(), torch.tensor([0.1, 0.2]), learn_locality=True)
    assert isinstance(m.locality, nn.Parameter)
    out, _ = m(_x(seed=3))
    out.pow(2).sum().backward()
    assert m.locality.grad is not None and torch.isfinite(m.locality.grad).all()
    assert m.locality.grad.abs().sum() > 0


def test_dropout_training_path_and_fully_padded_query_rows():
    m = RegularizedMultiheadAttention(8, 2, Tsallis(1.5), dropout=0.5)
    m.train()
    out, _ = m(_x(seed=4))
    assert torch.isfinite(out).all()
    m.eval()
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[1] = True  # query 1 may attend nowhere
    out, w = m(_x(seed=4), attn_mask=mask, need_weights=True, average_attn_weights=False)
    assert (w[:, :, 1] == 0).all() and torch.isfinite(out).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="per-head locality"):
        RegularizedMultiheadAttention(8, 2, locality=torch.ones(3))
    with pytest.raises(ValueError, match="learn_locality"):
        RegularizedMultiheadAttention(8, 2, learn_locality=True)
    with pytest.raises(TypeError, match="conjugate_grad"):
        RegularizedMultiheadAttention(8, 2, regularizer="sparsemax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        RegularizedMultiheadAttention(8, 2, locality=float("inf"))
    assert "Shannon" in repr(RegularizedMultiheadAttention(8, 2, Shannon(2.0)))
