"""Every registry module takes what ``nn.MultiheadAttention(batch_first=True)`` takes.

Constructor: ``dropout``, ``bias``, ``kdim``, ``vdim`` (and ``batch_first=True``, ``device``,
``dtype``) through :func:`make_attention`; call: positional order, ``need_weights``,
``average_attn_weights`` (PyTorch's default: the head average), unbatched ``(L, E)`` input.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from attnopt.nn import attention_names, attention_spec, make_attention

MHA_NAMES = [n for n in attention_names() if attention_spec(n).multihead_convention]
E, H = 8, 2


def _build(name: str, seeded: bool = True, **opts):
    torch.manual_seed(0)
    extra = {"seed": 0} if seeded and name.startswith(("ika", "ikan", "mikan")) else {}
    return make_attention(name, E, H, **extra, **opts).double().eval()


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", MHA_NAMES)
def test_module_options_bias_kdim_vdim(name):
    m = _build(name, bias=False, kdim=6, vdim=5, dropout=0.1)
    projections = [m.q_proj, m.k_proj, m.v_proj, m.out_proj]
    assert all(p.bias is None for p in projections)
    assert (m.k_proj.in_features, m.v_proj.in_features) == (6, 5) and m.dropout == 0.1
    out, w = m(_x(2, 4, E), _x(2, 3, 6, seed=2), _x(2, 3, 5, seed=3), need_weights=True)
    assert out.shape == (2, 4, E) and w.shape == (2, 4, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("name", MHA_NAMES)
def test_average_attn_weights_and_positional_order(name):
    m = _build(name)
    x = _x(2, 5, E)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    # nn.MultiheadAttention's positional order: key_padding_mask, need_weights, attn_mask, average
    out, per_head = m(x, x, x, kpm, True, None, False)
    out2, mean = m(x, x, x, key_padding_mask=kpm, need_weights=True)
    assert per_head.shape == (2, H, 5, 5) and mean.shape == (2, 5, 5)
    torch.testing.assert_close(mean, per_head.mean(1))
    torch.testing.assert_close(out, out2)
    assert m(x)[1] is None  # need_weights defaults to False (documented: O(N) paths)


@pytest.mark.parametrize("name", MHA_NAMES)
def test_unbatched_input(name):
    m = _build(name)
    x = _x(5, E)
    kpm = torch.tensor([False, False, False, True, False])
    mask = torch.zeros(H, 5, 5, dtype=torch.bool)
    mask[:, 0, 1:] = True  # query 0 sees key 0 only, in every head
    out, w = m(x, key_padding_mask=kpm, attn_mask=mask, need_weights=True, average_attn_weights=False)
    ref, wr = m(x[None], key_padding_mask=kpm[None], attn_mask=mask, need_weights=True,
                average_attn_weights=False)
    assert out.shape == (5, E) and w.shape == (H, 5, 5)
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(w, wr[0])
    assert float(w[:, :, 3].detach().abs().max()) == 0.0  # the padded key
    assert m(x, need_weights=True)[1].shape == (5, 5)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        m(x, key_padding_mask=kpm[None])


@pytest.mark.parametrize("name", MHA_NAMES)
def test_dropout_acts_in_training_only(name):
    m = _build(name, seeded=False, dropout=0.5)  # IKA: training noise from the global RNG
    x = _x(2, 6, E)
    clean = m(x)[0]
    m.dropout = 0.0
    torch.testing.assert_close(m(x)[0], clean)  # eval(): no dropout whatever its value
    m.train()
    torch.manual_seed(3)
    no_drop = m(x)[0]
    m.dropout = 0.5
    torch.manual_seed(3)
    a = m(x)[0]
    torch.manual_seed(3)
    b = m(x)[0]
    torch.testing.assert_close(a, b)  # one seed, one draw
    assert (a - no_drop).abs().max() > 1e-6  # the weights were dropped
    a.sum().backward()
    assert m.q_proj.weight.grad is not None


def test_registry_options_and_refusals():
    m = make_attention("dnas", 32, 4, dropout=0.1, bias=False, dtype=torch.float64)
    assert m.dropout == 0.1 and m.q_proj.bias is None and m.q_proj.weight.dtype == torch.float64
    ot = make_attention("ot", 16, 2, dropout=0.2, bias=False)
    assert ot.dropout == 0.2 and ot.q_proj.bias is None
    with pytest.raises(ValueError, match="add_bias_kv is not supported"):
        make_attention("softmax", 8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="batch_first=True"):
        make_attention("softmax", 8, 2, batch_first=False)
    with pytest.raises(ValueError, match=r"no option 'dropuot'.*dropout, bias, kdim, vdim"):
        make_attention("dnas", 8, 2, dropuot=0.1)
    with pytest.raises(ValueError, match="no option 'kdim'"):  # a pooling layer over one token set
        make_attention("ot", 8, 2, kdim=4)
    with pytest.raises(ValueError, match="dropout"):
        make_attention("hnas", 8, 2, dropout=1.5)


def test_softmax_module_matches_torch_multihead_attention_in_every_call_form():
    """Same parameters, same calls (positional, unbatched, averaged weights) as nn.MultiheadAttention."""
    ours = _build("softmax", kdim=6, vdim=5)
    ref = nn.MultiheadAttention(E, H, batch_first=True, kdim=6, vdim=5, dtype=torch.float64).eval()
    with torch.no_grad():
        ref.q_proj_weight.copy_(ours.q_proj.weight)
        ref.k_proj_weight.copy_(ours.k_proj.weight)
        ref.v_proj_weight.copy_(ours.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    q, k, v = _x(4, E), _x(3, 6, seed=2), _x(3, 5, seed=3)
    kpm = torch.tensor([False, True, False])
    for args in ((q, k, v, kpm, True), (q[None], k[None], v[None], kpm[None], True, None, False)):
        (o1, w1), (o2, w2) = ours(*args), ref(*args)
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(w1, w2)
