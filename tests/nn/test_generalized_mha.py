"""GeneralizedMultiheadAttention: equals nn.MultiheadAttention for uniform u, honours masks."""
import pytest
import torch
from torch import nn

import attnopt
from attnopt.nn import ALiBiPreference, GeneralizedMultiheadAttention, KeyPreference, T5RelativePreference


def copy_from_torch(ours: GeneralizedMultiheadAttention, ref: nn.MultiheadAttention) -> None:
    e = ref.embed_dim
    with torch.no_grad():
        for i, lin in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            lin.weight.copy_(ref.in_proj_weight[i * e:(i + 1) * e])
            lin.bias.copy_(ref.in_proj_bias[i * e:(i + 1) * e])
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("masks", ["none", "padding", "attn_bool", "attn_float", "causal"])
def test_uniform_preference_equals_torch_mha(masks):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(12, 3, batch_first=True).double()
    ours = GeneralizedMultiheadAttention(12, 3).double()
    copy_from_torch(ours, ref)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    kw = {}
    if masks == "padding":
        kw["key_padding_mask"] = torch.tensor([[False] * 5, [False, False, False, True, True]])
    elif masks == "attn_bool":
        kw["attn_mask"] = torch.rand(5, 5) > 0.7
        kw["attn_mask"].fill_diagonal_(False)
    elif masks == "attn_float":
        kw["attn_mask"] = torch.randn(5, 5, dtype=torch.float64)
    elif masks == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    y_ref, w_ref = ref(x, x, x, need_weights=True, average_attn_weights=False, **kw)
    y, w = ours(x, need_weights=True, average_attn_weights=False, is_causal=masks == "causal", **kw)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(w, w_ref)


@pytest.mark.parametrize("pref", ["t5", "alibi", "key"])
def test_preference_enters_as_log_u(pref):
    torch.manual_seed(1)
    module = {"t5": T5RelativePreference(2, num_buckets=8, max_distance=16), "alibi": ALiBiPreference(2),
              "key": KeyPreference(8, 2)}[pref]
    mha = GeneralizedMultiheadAttention(8, 2, preference=module).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    y, w = mha(x, need_weights=True, average_attn_weights=False)
    q, k, v = (mha.split_heads(p(x)) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    log_u = module.log_preference(x, x).double()
    w_ref = attnopt.generalized_weights(q, k, log_preference=log_u)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(y, mha.out_proj(mha.merge_heads(w_ref @ v)))


def test_t5_preference_is_learned_through_attention():
    pref = T5RelativePreference(2, num_buckets=8, max_distance=16)
    mha = GeneralizedMultiheadAttention(8, 2, preference=pref)
    x = torch.randn(2, 6, 8)
    mha(x, is_causal=True)[0].square().sum().backward()
    grad = mha.preference.relative_attention_bias.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_bad_construction():
    with pytest.raises(ValueError, match="divisible"):
        GeneralizedMultiheadAttention(10, 3)
    with pytest.raises(TypeError, match="preference"):
        GeneralizedMultiheadAttention(8, 2, preference=torch.ones(3))
    with pytest.raises(ValueError, match="batch_first"):
        GeneralizedMultiheadAttention(8, 2)(torch.randn(8))
    with pytest.raises(ValueError, match="query is unbatched"):  # (L, E) query: key/value 2-D too
        GeneralizedMultiheadAttention(8, 2)(torch.randn(5, 8), torch.randn(1, 5, 8))
