"""Vision Transformer and OT-ViT (fenchel-dual-attention Sec. 9, Tables 1–2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.models._blocks import (
    AttentionChoice,
    EncoderBlock,
    OptionsChoice,
    _FeedForward,
    layer_attentions,
)
from attnopt.nn.registry import make_attention

__all__ = ["ViT"]


class ViT(nn.Module):
    r"""ViT: patch embedding, class token, learned positions, pre-LN blocks, linear head.

    With ``ot_last_layer=True`` this is the OT-ViT of fenchel-dual-attention Sec. 9: identical
    except the last layer, where the class token aggregates the patch templates with OT-based
    attention (eq. 22, :class:`attnopt.nn.OTAttention`, ``M(a, b) = −aᵀb + C``, ``α = 1``,
    ``γ = √d_model`` by default) instead of softmax attention:

    .. math:: c \leftarrow c + \mathrm{OT}(\mathrm{LN}(x_{1:N}); \text{bank}),\qquad
              c \leftarrow c + \mathrm{FFN}(\mathrm{LN}(c))

    (the ViT's last block computes the same for its class token with softmax attention over
    all tokens). The template bank holds the input's patch templates and, when
    ``bank_images`` is given, the patch templates of those images (computed by the same
    first L−1 layers): the paper trains with, half the time, another image of the same class
    in the bank, and tests with the input's templates only.

    Args:
        image_size: H = W of the (square) images.  patch_size: P (divides ``image_size``).
        in_channels: C.  d_model: E.  num_heads: H.  num_layers: L (>= 1; OT-ViT: >= 1, the
            last one is the OT layer).
        num_classes: classifier outputs.
        attention: registry name(s) of the self-attention layers (a list has one name per
            softmax-style layer: L, or L−1 with ``ot_last_layer``).
        attention_options: options of those layers.
        ot_last_layer: make the last layer OT-based attention (OT-ViT).
        ot_options: options of the ``ot`` registry entry (``alpha``, ``gamma``, ``cost``).
        dim_feedforward: MLP width (default ``4 * d_model``).  dropout: dropout rate.

    ``forward(images (B, C, H, W), *, bank_images=None (B, C, H, W), bank_mask=None (B,)
    bool) -> logits (B, num_classes)``; ``bank_mask[b] = False`` leaves example ``b``'s bank
    empty (only its own templates). ``bank_images`` requires ``ot_last_layer``.
    """

    def __init__(
        self,
        *,
        image_size: int,
        patch_size: int,
        in_channels: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        num_classes: int,
        attention: AttentionChoice = "softmax",
        attention_options: OptionsChoice = None,
        ot_last_layer: bool = False,
        ot_options: Mapping[str, Any] | None = None,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size ({patch_size}) must divide image_size ({image_size})")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        n_patches = (image_size // patch_size) ** 2
        ff = dim_feedforward or 4 * d_model
        self.image_size, self.in_channels, self.ot_last_layer = image_size, in_channels, ot_last_layer
        self.patch = nn.Conv2d(in_channels, d_model, patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)
        n_self = num_layers - 1 if ot_last_layer else num_layers
        attns = nn.ModuleList()
        if n_self:
            attns = layer_attentions(attention, attention_options, n_self, d_model, num_heads)
        self.layers = nn.ModuleList(EncoderBlock(d_model, a, ff, dropout) for a in attns)
        if ot_last_layer:
            self.ot = make_attention("ot", d_model, num_heads, **dict(ot_options or {}))
            self.ot_norm1, self.ot_norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.ot_ff = _FeedForward(d_model, ff, dropout)
        elif ot_options:
            raise ValueError("ot_options given without ot_last_layer=True")
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def _check(self, x: Tensor, name: str) -> None:
        shape = (self.in_channels, self.image_size, self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != shape:
            raise ValueError(f"{name} must be (B, {', '.join(map(str, shape))}), got {tuple(x.shape)}")

    def tokens(self, images: Tensor) -> Tensor:
        """States ``(B, 1 + N, E)`` (class token first) after the softmax-style layers."""
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        x = self.drop(x + self.pos.to(x.dtype))
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(
        self, images: Tensor, *, bank_images: Tensor | None = None, bank_mask: Tensor | None = None
    ) -> Tensor:
        self._check(images, "images")
        if not self.ot_last_layer:
            if bank_images is not None:
                raise ValueError("bank_images needs ot_last_layer=True (OT-ViT)")
            return self.head(self.norm(self.tokens(images)[:, 0]))
        b = images.shape[0]
        bank_pad = None
        if bank_images is not None:
            self._check(bank_images, "bank_images")
            if bank_images.shape[0] != b:
                raise ValueError("bank_images must have one image per input image")
            sel = (
                torch.arange(b, device=images.device)
                if bank_mask is None
                else bank_mask.nonzero().squeeze(-1)
            )
            if bank_mask is not None and (bank_mask.dtype != torch.bool or bank_mask.shape != (b,)):
                raise ValueError(f"bank_mask must be a bool ({b},) tensor")
            x_all = self.tokens(torch.cat([images, bank_images[sel]], dim=0))  # one batched pass
            x, extra = x_all[:b], x_all[b:, 1:]
            bank = x.new_zeros(b, extra.shape[1], x.shape[-1]).index_copy(0, sel, extra)
            bank_pad = torch.ones(b, extra.shape[1], dtype=torch.bool, device=x.device)
            bank_pad[sel] = False
        else:
            x, bank = self.tokens(images), None
        c = x[:, 0]
        nb = None if bank is None else self.ot_norm1(bank)
        pooled, _ = self.ot(self.ot_norm1(x[:, 1:]), bank=nb, bank_padding_mask=bank_pad)
        c = c + self.drop(pooled)
        c = c + self.drop(self.ot_ff(self.ot_norm2(c)))
        return self.head(self.norm(c))
