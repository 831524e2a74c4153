"""The attention registry: every name builds, follows the MHA convention, rejects bad input."""

from __future__ import annotations

import pytest
import torch

from attnopt.nn import attention_names, attention_spec, make_attention

MHA_NAMES = [n for n in attention_names() if attention_spec(n).multihead_convention]
EXPECTED = {
    "softmax",
    "t5",
    "alibi",
    "mem",
    "lnas",
    "dnas",
    "hnas",
    "sinkhorn",
    "sparsemax",
    "entmax",
    "rbf-only",
    "expsin",
    "linear",
    "ika-s",
    "ika-ns",
    "ikan",
    "ikan-direct",
    "mikan",
    "ot",
}


def test_names_are_the_contracts() -> None:
    assert set(attention_names()) == EXPECTED
    assert len(attention_names()) == len(EXPECTED)


@pytest.mark.parametrize("name", MHA_NAMES)
def test_every_name_round_trips_the_mha_convention(name: str) -> None:
    torch.manual_seed(0)
    m = make_attention(name, 8, 2).eval()
    q, kv = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    out, w = m(q, kv, kv, need_weights=True, average_attn_weights=False)
    assert out.shape == (2, 5, 8) and w is not None and w.shape == (2, 2, 5, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5), atol=1e-5, rtol=0)
    # key padding = truncation of the keys
    pad = torch.tensor([[False, False, True]] * 2)
    full, _ = m(q, kv, kv, key_padding_mask=pad)
    trunc, _ = m(q, kv[:, :2], kv[:, :2])
    if name not in ("ika-s", "ika-ns", "ikan", "mikan"):  # their spectral points depend on the key set
        torch.testing.assert_close(full, trunc, atol=1e-5, rtol=1e-4)
    out2, none = m(q)
    assert out2.shape == (2, 5, 8) and none is None


def test_options_are_passed_and_checked() -> None:
    assert make_attention("sinkhorn", 8, 2, iterations=5).iterations == 5
    assert make_attention("entmax", 8, 2, alpha=1.25).regularizer.alpha == 1.25
    assert make_attention("entmax", 8, 2, alpha=0.5).regularizer.alpha == 0.5  # dense Tsallis map
    with pytest.raises(ValueError, match="valid options: iterations"):
        make_attention("sinkhorn", 8, 2, alpha=2.0)
    with pytest.raises(ValueError, match="valid names: softmax"):
        make_attention("softmaxx", 8, 2)
    with pytest.raises(ValueError, match="valid options: causal; and the nn.MultiheadAttention options"):
        make_attention("dnas", 8, 2, iterations=2)
    with pytest.raises(ValueError, match="valid options: none"):
        make_attention("softmax", 8, 2, iterations=2)
    with pytest.raises(ValueError):
        make_attention("entmax", 8, 2, alpha=0.0)  # any α > 0 is valid; 0 is not


def test_ot_is_the_pooling_convention() -> None:
    m = make_attention("ot", 8, 2)
    out, _ = m(torch.randn(2, 5, 8), bank=torch.randn(2, 3, 8))
    assert out.shape == (2, 8)
    assert m.gamma == pytest.approx(8**0.5) and m.alpha == 1.0


def test_ika_variants_have_kl() -> None:
    for name in ("ika-s", "ika-ns", "ikan", "mikan"):
        m = make_attention(name, 8, 2)
        m(torch.randn(2, 4, 8))
        assert m.kl().dim() == 0
