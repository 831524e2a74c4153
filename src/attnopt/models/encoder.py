"""A pre-LN Transformer encoder with the attention chosen by registry name, per layer if wanted."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnopt.models._blocks import (
    AttentionChoice,
    EncoderBlock,
    OptionsChoice,
    layer_attentions,
    make_positions,
)

__all__ = ["TransformerEncoder"]


class TransformerEncoder(nn.Module):
    """Pre-LN Transformer encoder over token ids or float features, with an optional head.

    Args:
        d_model: E.  num_heads: H.  num_layers: L.
        attention: a registry name for every layer (``"dnas"``) or a list of L names.
        attention_options: a dict for every layer, a list of L dicts, or ``None``.
        vocab_size: token-id input (``x`` LongTensor (B, N)); exclusive with ``input_dim``.
        input_dim: float-feature input (``x`` (B, N, input_dim)).
        max_len: longest sequence (positions).
        positions: ``"sinusoidal"``, ``"learned"`` or ``None``.
        dim_feedforward: MLP width (default ``4 * d_model``).
        dropout: residual/MLP/embedding dropout.
        num_outputs: size of the classification/regression head; ``None`` = no head.
        pooling: ``"cls"`` (a learned class token is prepended) or ``"mean"`` (mean over the
            non-padding tokens) — used by the head.

    ``forward(x, *, key_padding_mask=None)`` -> ``(B, num_outputs)`` with a head, else
    ``(B, N, E)``. ``key_padding_mask (B, N)`` is boolean, ``True`` = padding; padded
    positions are masked as keys *and* as queries, passed to every layer as O(N) masks (no
    ``N × N`` mask; see :func:`attnopt.models._blocks.call_attention`).

    Raises:
        ValueError: neither or both of ``vocab_size``/``input_dim``, bad pooling/positions,
            a wrong-length attention list, unknown attention name/option.
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        num_layers: int,
        attention: AttentionChoice = "softmax",
        attention_options: OptionsChoice = None,
        vocab_size: int | None = None,
        input_dim: int | None = None,
        max_len: int = 512,
        positions: str | None = "sinusoidal",
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        num_outputs: int | None = None,
        pooling: str = "cls",
    ) -> None:
        super().__init__()
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("give exactly one of vocab_size (token ids) or input_dim (float features)")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.pooling = pooling
        self.embed: nn.Module
        if vocab_size is not None:
            self.embed = nn.Embedding(vocab_size, d_model)
        else:
            assert input_dim is not None  # exactly one of the two is given (checked above)
            self.embed = nn.Linear(int(input_dim), d_model)
        self.positions = make_positions(positions, d_model, max_len)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model)) if pooling == "cls" else None
        ff = dim_feedforward or 4 * d_model
        attns = layer_attentions(attention, attention_options, num_layers, d_model, num_heads)
        self.layers = nn.ModuleList(EncoderBlock(d_model, a, ff, dropout) for a in attns)
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, num_outputs) if num_outputs is not None else None

    def encode(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Final (layer-normed) token states ``(B, N, E)`` (the class token, if any, dropped)."""
        h = self._states(x, key_padding_mask)
        return h[:, 1:] if self.cls is not None else h

    def _states(self, x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        h = self.drop(self.positions(self.embed(x)))
        pad = key_padding_mask
        if pad is not None and (pad.dtype != torch.bool or pad.shape != h.shape[:2]):
            raise ValueError(f"key_padding_mask must be a bool (B, N) = {tuple(h.shape[:2])} tensor")
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1).to(h.dtype), h], dim=1)
            if pad is not None:
                pad = torch.cat([pad.new_zeros(pad.shape[0], 1), pad], dim=1)
        for layer in self.layers:
            h = layer(h, key_padding_mask=pad, query_padding_mask=pad)
        return self.norm(h)

    def _pool(self, h: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        if self.cls is not None:
            return h[:, 0]
        if key_padding_mask is None:  # an empty sequence pools to 0, as a fully padded one (not NaN)
            return h.mean(1) if h.shape[1] else h.sum(1)
        keep = (~key_padding_mask).to(h.dtype).unsqueeze(-1)
        return (h * keep).sum(1) / keep.sum(1).clamp_min(1.0)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        if self.head is None:
            return self.encode(x, key_padding_mask)
        return self.head(self._pool(self._states(x, key_padding_mask), key_padding_mask))
