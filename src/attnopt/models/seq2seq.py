"""Encoder–decoder Transformer (causal decoder, cross-attention) with greedy and beam decoding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnopt.models._blocks import (
    AttentionChoice,
    DecoderBlock,
    EncoderBlock,
    OptionsChoice,
    layer_attentions,
    make_positions,
)

__all__ = ["EncoderDecoder"]


class EncoderDecoder(nn.Module):
    """Pre-LN encoder–decoder Transformer with the attention of each part chosen by name.

    Args:
        src_vocab_size, tgt_vocab_size: vocabularies (token ids; ``pad_id`` is padding in both).
        d_model, num_heads: E, H.
        num_encoder_layers, num_decoder_layers: depths.
        encoder_attention, decoder_attention, cross_attention: a registry name or a list per
            layer (encoder self-, decoder causal self-, decoder cross-attention).
        attention_options: options for every attention, or a dict ``{"encoder": ...,
            "decoder": ..., "cross": ...}`` of per-part options (each a dict or list per layer).
        dim_feedforward: MLP width (default ``4 * d_model``).
        dropout: residual/MLP/embedding dropout.
        max_len: longest source/target sequence (sinusoidal positions).
        pad_id: padding token id.

    Note:
        Mechanisms that normalize over *queries* (``dnas``, ``hnas``, ``sinkhorn``) couple the
        decoder's positions: a key's column normalization runs over the queries, and the causal
        mask removes only later *keys*. The decoder self-attention is called with
        ``is_causal=True`` and so runs their autoregressive variant (``causal="prefix"``: position
        ``i`` normalizes over target positions ``≤ i``). The cross-attention has no causal mask:
        with teacher forcing its column normalization over the target queries includes later
        target positions unless it is built with ``causal="prefix"``
        (``attention_options={"cross": {"causal": "prefix"}}``). Decoding re-runs the decoder on
        the whole prefix each step, so the model sees at test time what it saw in training for
        that prefix length.

    ``forward(src (B, Ns), tgt_in (B, Nt)) -> logits (B, Nt, tgt_vocab_size)``; padding masks
    default to ``src == pad_id`` / ``tgt_in == pad_id``.
    """

    def __init__(
        self,
        *,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int,
        num_heads: int,
        num_encoder_layers: int,
        num_decoder_layers: int,
        encoder_attention: AttentionChoice = "softmax",
        decoder_attention: AttentionChoice = "softmax",
        cross_attention: AttentionChoice = "softmax",
        attention_options: OptionsChoice | dict[str, OptionsChoice] = None,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        max_len: int = 512,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        if num_encoder_layers < 1 or num_decoder_layers < 1:
            raise ValueError("num_encoder_layers and num_decoder_layers must be >= 1")
        opts = attention_options
        if isinstance(opts, dict) and set(opts) and set(opts) <= {"encoder", "decoder", "cross"}:
            enc_o, dec_o, cross_o = opts.get("encoder"), opts.get("decoder"), opts.get("cross")
        else:
            enc_o = dec_o = cross_o = opts
        ff = dim_feedforward or 4 * d_model
        self.pad_id, self.d_model = pad_id, d_model
        self.src_embed = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model)
        self.positions = make_positions("sinusoidal", d_model, max_len)
        enc = layer_attentions(
            encoder_attention,
            enc_o,
            num_encoder_layers,
            d_model,
            num_heads,
            what="encoder_attention",
        )
        dec = layer_attentions(
            decoder_attention,
            dec_o,
            num_decoder_layers,
            d_model,
            num_heads,
            what="decoder_attention",
        )
        cross = layer_attentions(
            cross_attention,
            cross_o,
            num_decoder_layers,
            d_model,
            num_heads,
            what="cross_attention",
        )
        self.encoder = nn.ModuleList(EncoderBlock(d_model, a, ff, dropout) for a in enc)
        self.decoder = nn.ModuleList(
            DecoderBlock(d_model, a, c, ff, dropout) for a, c in zip(dec, cross, strict=True)
        )
        self.enc_norm, self.dec_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, tgt_vocab_size)

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """Encoder states ``(B, Ns, E)``."""
        pad = (src == self.pad_id) if src_padding_mask is None else src_padding_mask
        h = self.drop(self.positions(self.src_embed(src)))
        pad_opt = pad if bool(pad.any()) else None
        for layer in self.encoder:
            h = layer(h, key_padding_mask=pad_opt, query_padding_mask=pad_opt)
        return self.enc_norm(h)

    def decode(
        self,
        memory: Tensor,
        tgt_in: Tensor,
        *,
        src_padding_mask: Tensor | None,
        tgt_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, Nt, V)`` for the target prefix ``tgt_in`` given encoder ``memory``."""
        tpad = (tgt_in == self.pad_id) if tgt_padding_mask is None else tgt_padding_mask
        tpad_opt = tpad if bool(tpad.any()) else None
        spad_opt = src_padding_mask if src_padding_mask is not None and bool(src_padding_mask.any()) else None
        h = self.drop(self.positions(self.tgt_embed(tgt_in)))
        for layer in self.decoder:  # O(N) padding masks, causality as a flag
            h = layer(h, memory, padding_mask=tpad_opt, memory_padding_mask=spad_opt, is_causal=True)
        return self.out(self.dec_norm(h))

    def forward(
        self,
        src: Tensor,
        tgt_in: Tensor,
        *,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
    ) -> Tensor:
        spad = (src == self.pad_id) if src_padding_mask is None else src_padding_mask
        memory = self.encode(src, spad)
        return self.decode(memory, tgt_in, src_padding_mask=spad, tgt_padding_mask=tgt_padding_mask)

    @torch.no_grad()
    def greedy_decode(
        self, src: Tensor, *, bos_id: int, eos_id: int, max_len: int, src_padding_mask: Tensor | None = None
    ) -> Tensor:
        """Greedy decoding: ``LongTensor (B, <= max_len)`` of generated ids (no BOS), each row
        ending at its first ``eos_id`` (included) and padded with ``pad_id`` after it."""
        spad = (src == self.pad_id) if src_padding_mask is None else src_padding_mask
        memory = self.encode(src, spad)
        b = src.shape[0]
        seq = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(b, dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            logits = self.decode(
                memory, seq, src_padding_mask=spad, tgt_padding_mask=torch.zeros_like(seq, dtype=torch.bool)
            )[:, -1]
            nxt = logits.argmax(-1).masked_fill(done, self.pad_id)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            done = done | (nxt == eos_id)
            if bool(done.all()):
                break
        return seq[:, 1:]

    @torch.no_grad()
    def beam_decode(
        self,
        src: Tensor,
        *,
        bos_id: int,
        eos_id: int,
        max_len: int,
        src_padding_mask: Tensor | None = None,
        beam_size: int = 4,
        length_penalty: float = 1.0,
    ) -> Tensor:
        """Beam search per example: the hypothesis maximizing ``log p / len^length_penalty``.

        Returns ``LongTensor (B, <= max_len)`` as :meth:`greedy_decode`. ``beam_size=1`` is
        greedy decoding.

        Raises:
            ValueError: ``beam_size < 1``.
        """
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        spad = (src == self.pad_id) if src_padding_mask is None else src_padding_mask
        results: list[list[int]] = []
        for i in range(src.shape[0]):
            results.append(
                self._beam_one(
                    src[i : i + 1], spad[i : i + 1], bos_id, eos_id, max_len, beam_size, length_penalty
                )
            )
        width = max(1, max(len(r) for r in results))
        out = torch.full((len(results), width), self.pad_id, dtype=torch.long, device=src.device)
        for i, r in enumerate(results):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=src.device)
        return out

    def _beam_one(
        self, src: Tensor, spad: Tensor, bos_id: int, eos_id: int, max_len: int, k: int, lp: float
    ) -> list[int]:
        memory = self.encode(src, spad)
        beams = torch.full((1, 1), bos_id, dtype=torch.long, device=src.device)
        scores = torch.zeros(1, device=src.device)
        finished: list[tuple[float, list[int]]] = []
        for step in range(max_len):
            n = beams.shape[0]
            logits = self.decode(
                memory.expand(n, -1, -1),
                beams,
                src_padding_mask=spad.expand(n, -1),
                tgt_padding_mask=torch.zeros_like(beams, dtype=torch.bool),
            )[:, -1]
            logp = torch.log_softmax(logits.float(), -1) + scores[:, None]
            top, idx = logp.flatten().topk(min(2 * k, logp.numel()))
            vocab = logp.shape[-1]
            new_beams, new_scores = [], []
            for s, j in zip(top.tolist(), idx.tolist(), strict=True):
                b, tok = divmod(j, vocab)
                hyp = beams[b].tolist()[1:] + [tok]
                if tok == eos_id:
                    finished.append((s / (len(hyp) ** lp), hyp))
                else:
                    new_beams.append(beams[b].tolist() + [tok])
                    new_scores.append(s)
                if len(new_beams) == k:
                    break
            best_open = max(new_scores) / ((step + 1) ** lp) if new_scores else float("-inf")
            if len(finished) >= k and max(f[0] for f in finished) >= best_open or not new_beams:
                break
            beams = torch.tensor(new_beams, dtype=torch.long, device=src.device)
            scores = torch.tensor(new_scores, device=src.device)
        if not finished:
            best = int(torch.argmax(scores))
            return beams[best].tolist()[1:]
        return max(finished, key=lambda f: f[0])[1]
