"""MEMAttention / MEMEstimate modules: agree with the functional solver, masks, gradients."""
import pytest
import torch

from attnopt.dual import mem_estimate, mem_weights
from attnopt.nn import GeneralizedMultiheadAttention, MEMAttention, MEMEstimate, T5RelativePreference

F64 = torch.float64


def test_mem_attention_module_matches_functional_weights():
    torch.manual_seed(0)
    m = MEMAttention(12, 3, scale=0.6).double()
    x = torch.randn(2, 5, 12, dtype=F64)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    y, w = m(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert y.shape == (2, 5, 12) and w.shape == (2, 3, 5, 5)
    q, k = m.split_heads(m.q_proj(x)), m.split_heads(m.k_proj(x))
    ref = mem_weights(q, k, attn_mask=~kpm.view(2, 1, 1, 5), scale=0.6)
    torch.testing.assert_close(w, ref)
    assert torch.all(w[1, :, :, 3:] == 0)
    v = m.split_heads(m.v_proj(x))
    torch.testing.assert_close(y, m.out_proj(m.merge_heads(ref @ v)))


def test_small_scale_close_to_generalized_and_gradients_flow():
    torch.manual_seed(1)
    pref = T5RelativePreference(2, num_buckets=8, max_distance=16)
    m = MEMAttention(8, 2, preference=pref, scale=0.02).double()
    g = GeneralizedMultiheadAttention(8, 2, preference=pref).double()
    g.load_state_dict(m.state_dict())
    x = torch.randn(1, 6, 8, dtype=F64)
    # generalized uses the default scale 1/sqrt(4); compare at the same α by rescaling q
    with torch.no_grad():
        g.q_proj.weight.mul_(0.02 * 2.0)
        g.q_proj.bias.mul_(0.02 * 2.0)
    ym, _ = m(x, is_causal=True)
    yg, _ = g(x, is_causal=True)
    torch.testing.assert_close(ym, yg, atol=1e-4, rtol=1e-3)
    ym.square().sum().backward()
    assert pref.relative_attention_bias.weight.grad is not None
    assert torch.isfinite(pref.relative_attention_bias.weight.grad).all()
    assert float(m.k_proj.weight.grad.abs().sum()) > 0


def test_mem_estimate_module_and_errors():
    T = torch.randn(4, 3, dtype=F64)
    z = torch.randn(3, dtype=F64)
    layer = MEMEstimate(alpha=0.5)
    torch.testing.assert_close(layer(T, z), mem_estimate(T, z, alpha=0.5))
    assert "alpha=0.5" in repr(layer)
    with pytest.raises(ValueError, match="alpha"):
        MEMEstimate(alpha=-1.0)(T, z)
    with pytest.raises(ValueError, match="scale"):
        MEMAttention(8, 2, scale=0.0)
    with pytest.raises(TypeError, match="preference"):
        MEMAttention(8, 2, preference=torch.nn.Linear(2, 2))  # type: ignore[arg-type]
