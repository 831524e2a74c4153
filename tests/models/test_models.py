"""attnopt.models: every registry attention trains in every model; masks, decoding, OT-ViT bank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnopt.models import EncoderDecoder, TransformerEncoder, ViT, auxiliary_loss
from attnopt.nn import attention_names, attention_spec

MHA = [n for n in attention_names() if attention_spec(n).multihead_convention]


def _fit(model, loss_fn, steps: int = 8, lr: float = 1e-2) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    first = last = 0.0
    for i in range(steps):
        opt.zero_grad()
        loss = loss_fn() + auxiliary_loss(model) * 1e-3
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        first, last = (
            (float(loss.detach()), float(loss.detach())) if i == 0 else (first, float(loss.detach()))
        )
    return first, last


@pytest.mark.parametrize("name", MHA)
def test_encoder_loss_falls_for_every_attention(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randint(1, 12, (8, 6))
    y = (x[:, 0] > 6).long()
    m = TransformerEncoder(
        d_model=8, num_heads=2, num_layers=1, attention=name, vocab_size=12, num_outputs=2, dropout=0.0
    )
    first, last = _fit(m, lambda: F.cross_entropy(m(x), y))
    assert last < first


@pytest.mark.parametrize("name", MHA)
def test_encoder_decoder_and_vit_train_a_step(name: str) -> None:
    torch.manual_seed(0)
    src, tgt = torch.randint(3, 9, (4, 5)), torch.randint(3, 9, (4, 4))
    ed = EncoderDecoder(
        src_vocab_size=9,
        tgt_vocab_size=9,
        d_model=8,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        encoder_attention=name,
        decoder_attention=name,
        cross_attention=name,
        dropout=0.0,
    )
    first, last = _fit(ed, lambda: F.cross_entropy(ed(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten()))
    assert last < first
    v = ViT(
        image_size=4,
        patch_size=2,
        in_channels=1,
        d_model=8,
        num_heads=2,
        num_layers=1,
        num_classes=3,
        attention=name,
        dropout=0.0,
    )
    im, lab = torch.randn(6, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    first, last = _fit(v, lambda: F.cross_entropy(v(im), lab))
    assert last < first


def test_padding_equals_truncation_and_per_layer_attention() -> None:
    torch.manual_seed(0)
    m = TransformerEncoder(
        d_model=8,
        num_heads=2,
        num_layers=2,
        attention=["dnas", "sinkhorn"],
        vocab_size=10,
        num_outputs=3,
        pooling="mean",
    ).eval()
    x = torch.randint(1, 10, (2, 6))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    torch.testing.assert_close(m(x, key_padding_mask=pad)[1], m(x[1:, :4])[0], atol=1e-5, rtol=1e-5)
    assert type(m.layers[0].attention).__name__ == "DoublyNormalizedMultiheadAttention"
    assert m.layers[1].attention.iterations == 3
    with pytest.raises(ValueError, match="list of 2"):
        TransformerEncoder(d_model=8, num_heads=2, num_layers=2, attention=["dnas"], vocab_size=10)
    with pytest.raises(ValueError, match="pooling layer"):
        TransformerEncoder(d_model=8, num_heads=2, num_layers=1, attention="ot", vocab_size=10)
    enc = TransformerEncoder(d_model=8, num_heads=2, num_layers=1, input_dim=3, positions="learned")
    assert enc(torch.randn(2, 5, 3)).shape == (2, 5, 8)


def test_auxiliary_loss_sums_kl_of_ika_layers() -> None:
    torch.manual_seed(0)
    m = TransformerEncoder(
        d_model=8, num_heads=2, num_layers=2, attention=["ikan", "softmax"], vocab_size=10, num_outputs=2
    )
    assert float(auxiliary_loss(m)) == 0.0  # nothing run yet
    m(torch.randint(1, 10, (3, 4)))
    torch.testing.assert_close(auxiliary_loss(m), m.layers[0].attention.kl())
    with torch.no_grad():  # move the posterior away from the prior: the KL must be positive
        for p in m.layers[0].attention.densities[0].nn1[2].parameters():
            p.fill_(0.3)
    m(torch.randint(1, 10, (3, 4)))
    assert float(auxiliary_loss(m)) > 0


@pytest.mark.slow
def test_decoding_learns_a_copy_task() -> None:
    torch.manual_seed(0)
    ed = EncoderDecoder(
        src_vocab_size=8,
        tgt_vocab_size=8,
        d_model=32,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout=0.0,
    )
    opt = torch.optim.Adam(ed.parameters(), lr=3e-3)
    bos, eos = 1, 2
    for _ in range(150):
        src = torch.randint(3, 8, (16, 3))
        tgt = torch.cat([torch.full((16, 1), bos), src, torch.full((16, 1), eos)], 1)
        loss = F.cross_entropy(ed(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    ed.eval()
    src = torch.randint(3, 8, (6, 3))
    want = torch.cat([src, torch.full((6, 1), eos)], 1)
    assert torch.equal(ed.greedy_decode(src, bos_id=bos, eos_id=eos, max_len=6), want)
    assert torch.equal(ed.beam_decode(src, bos_id=bos, eos_id=eos, max_len=6, beam_size=3), want)
    assert torch.equal(ed.beam_decode(src, bos_id=bos, eos_id=eos, max_len=6, beam_size=1), want)


def test_vit_ot_last_layer_uses_the_bank_only_where_asked() -> None:
    torch.manual_seed(0)
    v = ViT(
        image_size=4,
        patch_size=2,
        in_channels=1,
        d_model=8,
        num_heads=2,
        num_layers=2,
        num_classes=3,
        ot_last_layer=True,
        dropout=0.0,
    ).eval()
    assert type(v.ot).__name__ == "OTAttention" and len(v.layers) == 1
    im, bank = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    plain = v(im)
    mixed = v(im, bank_images=bank, bank_mask=torch.tensor([True, False, True]))
    torch.testing.assert_close(mixed[1], plain[1])  # no bank for example 1
    assert not torch.allclose(mixed[0], plain[0])  # the bank moved example 0
    alone = v(im[:1], bank_images=bank[:1])
    torch.testing.assert_close(alone[0], mixed[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="ot_last_layer"):
        ViT(image_size=4, patch_size=2, in_channels=1, d_model=8, num_heads=2, num_layers=1, num_classes=3)(
            im, bank_images=bank
        )


def test_beam_of_one_is_greedy_and_rows_stop_at_eos() -> None:
    torch.manual_seed(3)
    ed = EncoderDecoder(
        src_vocab_size=6,
        tgt_vocab_size=6,
        d_model=8,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout=0.0,
    ).eval()
    src = torch.randint(3, 6, (4, 3))
    g = ed.greedy_decode(src, bos_id=1, eos_id=2, max_len=5)
    b = ed.beam_decode(src, bos_id=1, eos_id=2, max_len=5, beam_size=1)
    assert g.shape[1] <= 5
    for row_g, row_b in zip(g.tolist(), b.tolist(), strict=True):
        cut = row_g.index(2) + 1 if 2 in row_g else len(row_g)
        assert row_g[cut:] == [0] * (len(row_g) - cut)  # padded after EOS
        assert row_b[:cut] == row_g[:cut]
