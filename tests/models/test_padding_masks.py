"""Padding reaches the attention modules as O(N) masks and gives what the N × N mask gave.

The models used to build ``key padding ∪ query padding (∪ causal)`` as a ``(B, 1, N, N)`` mask
(:func:`attnopt.models._blocks.self_attention_mask`, kept as the reference here); they now pass
``key_padding_mask``/``query_padding_mask`` and ``is_causal`` to the modules. Every registry arm
must give the same states and gradients both ways (float64), padded rows and fully padded
sequences included.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from attnopt.models import EncoderDecoder, TransformerEncoder
from attnopt.models._blocks import EncoderBlock, call_attention, self_attention_mask
from attnopt.nn import attention_names, attention_spec, make_attention

ARMS: list[tuple[str, dict[str, Any]]] = [
    (n, {}) for n in attention_names() if attention_spec(n).multihead_convention
] + [("linear", {"mode": "linear"}), ("ikan", {"mode": "linear"})]
IDS = [n + ("-" + o["mode"] if o else "") for n, o in ARMS]
_IKA = {"ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"}


def _options(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    return {"num_samples": 4, "seed": 0, **opts} if name in _IKA else dict(opts)


def _encoder(name: str, opts: dict[str, Any]) -> TransformerEncoder:
    torch.manual_seed(0)
    return TransformerEncoder(
        d_model=8, num_heads=2, num_layers=2, attention=name, attention_options=_options(name, opts),
        vocab_size=11, dropout=0.0, pooling="mean",
    ).double().eval()


def _old_encoder_states(m: TransformerEncoder, x: Tensor, pad: Tensor) -> Tensor:
    """The encoder as it ran before: one boolean (B, 1, N, N) mask for every layer."""
    h = m.drop(m.positions(m.embed(x)))
    mask = self_attention_mask(pad, h.shape[1], h.shape[1])
    for layer in m.layers:
        h = layer(h, attn_mask=mask)
    return m.norm(h)


def _padding() -> Tensor:
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2] = True  # a fully padded sequence: every row of it has no admissible key
    return pad


def _grads(m: nn.Module, out: Tensor) -> list[Tensor]:
    m.zero_grad(set_to_none=True)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


@pytest.mark.parametrize(("name", "opts"), ARMS, ids=IDS)
def test_encoder_padding_without_n_by_n_mask_equals_the_old_mask(name: str, opts: dict[str, Any]) -> None:
    x = torch.randint(1, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    pad = _padding()
    m = _encoder(name, opts)
    new = m._states(x, pad)
    new_g = _grads(m, new)
    old = _old_encoder_states(m, x, pad)
    old_g = _grads(m, old)
    assert torch.isfinite(new).all()
    torch.testing.assert_close(new, old, rtol=1e-9, atol=1e-10)
    for a, b in zip(new_g, old_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def _seq2seq(name: str, opts: dict[str, Any], decoder: str | None = None) -> EncoderDecoder:
    torch.manual_seed(0)
    o: Any = _options(name, opts)
    if attention_spec(decoder or name).defaults.get("causal", False) is None:
        # normalizations over queries: the decoder's self-attention is autoregressive (causal="prefix",
        # the default under is_causal); the old explicit causal mask asks for it by name
        o = {"encoder": o, "decoder": {**o, "causal": "prefix"}, "cross": o}
    return EncoderDecoder(
        src_vocab_size=11, tgt_vocab_size=9, d_model=8, num_heads=2, num_encoder_layers=1,
        num_decoder_layers=2, encoder_attention=name, decoder_attention=decoder or name,
        cross_attention=name, attention_options=o, dropout=0.0,
    ).double().eval()


def _old_logits(m: EncoderDecoder, src: Tensor, tgt: Tensor) -> Tensor:
    """The encoder–decoder as it ran before: N × N masks with causality folded into them."""
    spad, tpad = src == m.pad_id, tgt == m.pad_id
    h = m.drop(m.positions(m.src_embed(src)))
    mask = self_attention_mask(spad, src.shape[1], src.shape[1])
    for layer in m.encoder:
        h = layer(h, attn_mask=mask)
    memory = m.enc_norm(h)
    nt, ns = tgt.shape[1], src.shape[1]
    self_mask = self_attention_mask(tpad, nt, nt, causal=True)
    cross_mask = self_attention_mask(spad, nt, ns, query_padding=tpad)
    h = m.drop(m.positions(m.tgt_embed(tgt)))
    for dec in m.decoder:
        h = dec(h, memory, self_mask=self_mask, cross_mask=cross_mask, is_causal=False)
    return m.out(m.dec_norm(h))


def _pairs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(2)
    src = torch.randint(1, 11, (3, 7), generator=g)
    src[0, 5:] = 0
    src[2] = 0  # a fully padded source: cross-attention rows with no admissible key
    tgt = torch.randint(1, 9, (3, 5), generator=g)
    tgt[1, 3:] = 0
    return src, tgt


@pytest.mark.parametrize(("name", "opts"), [a for a in ARMS if not a[1]], ids=IDS[: len(ARMS) - 2])
def test_causal_decoder_with_padding_equals_the_old_masks(name: str, opts: dict[str, Any]) -> None:
    src, tgt = _pairs()
    m = _seq2seq(name, opts)
    new = m(src, tgt)
    new_g = _grads(m, new)
    old = _old_logits(m, src, tgt)
    old_g = _grads(m, old)
    assert torch.isfinite(new).all()
    torch.testing.assert_close(new, old, rtol=1e-9, atol=1e-10)
    for a, b in zip(new_g, old_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", ["linear", "ikan"])
def test_linear_mode_now_runs_a_padded_causal_decoder_exactly(name: str) -> None:
    # the old (B, 1, N, N) causal ∪ padding mask was query-dependent: mode="linear" refused it
    src, tgt = _pairs()
    lin, quad = _seq2seq(name, {"mode": "linear"}), _seq2seq(name, {"mode": "quadratic"})
    quad.load_state_dict(lin.state_dict())
    with pytest.raises(ValueError, match="query-dependent"):
        _old_logits(lin, src, tgt)
    torch.testing.assert_close(lin(src, tgt), quad(src, tgt), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("name", "opts"), ARMS, ids=IDS)
def test_modules_get_key_only_masks(name: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-wise mechanisms see a (B, 1, 1, N) mask; only those normalizing over queries get more."""
    m = _encoder(name, opts)
    shapes: list[tuple[int, ...]] = []
    att = type(m.layers[0].attention)
    orig = att.attend

    def spy(self: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *a: Any) -> Any:
        shapes.append(tuple(mask.shape) if mask is not None else ())
        return orig(self, q, k, v, mask, *a)

    monkeypatch.setattr(att, "attend", spy)
    m._states(torch.randint(1, 11, (3, 6)), _padding())
    assert len(shapes) == 2
    preference = name in ("t5", "alibi")  # log u is N × N by itself
    if m.layers[0].attention.couples_queries or preference:
        assert all(s[-2:] == (6, 6) for s in shapes)
    else:
        assert all(s == (3, 1, 1, 6) for s in shapes)


@pytest.mark.parametrize("name", ["softmax", "dnas", "sparsemax", "ikan"])
def test_query_padding_mask_equals_the_full_mask_with_weights(name: str) -> None:
    torch.manual_seed(0)
    att = make_attention(name, 8, 2).double().eval()
    q, kv = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    kp = torch.tensor([[False, False, True, False], [False, True, True, True]])
    qp = torch.tensor([[False, True, False, False, True], [True, True, True, True, True]])
    full = kp[:, None, None, :] | qp[:, None, :, None]
    out, w = att(q, kv, kv, key_padding_mask=kp, query_padding_mask=qp, need_weights=True,
                 average_attn_weights=False)
    ref, wr = att(q, kv, kv, attn_mask=full, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, wr, rtol=1e-10, atol=1e-12)
    assert float(w[1].detach().abs().sum()) == 0.0  # every query padded: zero weights, not NaN
    add = torch.zeros(qp.shape, dtype=torch.float64).masked_fill(qp, float("-inf"))
    torch.testing.assert_close(att(q, kv, kv, key_padding_mask=kp, query_padding_mask=add)[0], out)


def test_query_padding_mask_is_validated() -> None:
    att = make_attention("softmax", 8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="query_padding_mask"):
        att(x, query_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="query_padding_mask"):
        att(x, query_padding_mask=torch.zeros(2, 5, dtype=torch.long))


def test_modules_without_query_padding_get_key_padding_and_zeroed_rows() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    out = call_attention(mha, x, x, key_padding_mask=pad, query_padding_mask=pad, is_causal=True)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref, _ = mha(x, x, x, key_padding_mask=pad, attn_mask=causal)
    torch.testing.assert_close(out[~pad], ref[~pad])
    assert float(out[pad].detach().abs().sum()) == 0.0
    block = EncoderBlock(8, mha, 16, dropout=0.0).double()
    h = block(x, key_padding_mask=pad, query_padding_mask=pad)
    assert torch.isfinite(h).all()


def test_mean_pooling_of_an_empty_sequence_is_finite() -> None:
    # h.mean(1) over no token was NaN logits (silently); a fully padded sequence already pooled to 0
    torch.manual_seed(0)
    model = TransformerEncoder(d_model=16, num_heads=2, num_layers=1, input_dim=4, num_outputs=3,
                               max_len=8, dropout=0.0, pooling="mean")
    empty = model(torch.randn(2, 0, 4))
    padded = model(torch.randn(2, 5, 4), key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    assert torch.isfinite(empty).all()
    torch.testing.assert_close(empty, padded)  # both: the head applied to a zero pooled state
