"""Learned-query pooling with OT-based attention: the last layer of OT-ViT (fenchel-dual Sec. 9)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnopt._validation import check_finite
from attnopt.functional.ot import ot_attention, ot_weights
from attnopt.nn._multihead import MultiheadBase

__all__ = ["OTAttention"]


def _padding_to_keep(mask: Tensor | None, batch: int, length: int, name: str) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean tensor (True = padding)")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must be (B, N) = ({batch}, {length}), got {tuple(mask.shape)}")
    return ~mask


class OTAttention(MultiheadBase):
    r"""Pool a set of tokens with a learned query through OT-based attention (eq. 22).

    The class-token pooling of OT-ViT: per head, the learned query gives the evidence
    ``z = W_q c``, the input tokens give the templates ``t_i = W_k x_i`` (uniform preference
    over the non-padding tokens) and the values ``W_v x_i``; the bank ``A`` is the templates
    plus, optionally, the projected ``bank`` tokens passed at call time (OT-ViT trains with,
    half of the time, the patch tokens of another image of the same class there). Bank members
    outside the input receive mass through the cost ``M``; then

    .. math:: \mathrm{out} = W_o \Big[\sum_{a\in A} p^*(a)\, W_v x_a\Big]_{\text{heads}}

    with ``p*`` from :func:`attnopt.ot_weights` (``α``, ``γ``, cost per head).

    Call convention (differs from ``nn.MultiheadAttention``: there is no external query)::

        out, weights = module(tokens, bank=None, key_padding_mask=None,
                              bank_padding_mask=None, need_weights=False)

    Args:
        embed_dim: E.
        num_heads: H.
        alpha: reliability ``α > 0`` (paper: 1).
        gamma: entropic strength ``γ > 0``; default ``sqrt(embed_dim)`` as in the paper.
        cost: ``"neg_dot"`` (paper), ``"sqeuclidean"`` or a callable on the per-head projected
            ``(bank (B,H,m,d), templates (B,H,n,d)) -> (B,H,m,n)``.
        bias: bias in the projections.
        dropout: dropout on the weights ``p*`` in training mode (as ``nn.MultiheadAttention``'s).

    Shapes: ``tokens (B, N, E)``, ``bank (B, M, E)``, ``key_padding_mask (B, N)`` and
    ``bank_padding_mask (B, M)`` boolean (``True`` = padding) -> ``out (B, E)`` and, with
    ``need_weights=True``, ``weights (B, H, N + M)`` (``p*`` over tokens then bank tokens).

    Raises:
        ValueError: bad sizes, ``alpha``/``gamma`` not > 0, an unknown cost name, mask shapes.
        TypeError: a tensor cost (sizes vary per call: use a callable), non-boolean masks.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        alpha: float = 1.0,
        gamma: float | None = None,
        cost: str | Callable[[Tensor, Tensor], Tensor] = "neg_dot",
        *,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, dropout=dropout)
        if isinstance(cost, Tensor) or not (isinstance(cost, str) or callable(cost)):
            raise TypeError("cost must be 'neg_dot', 'sqeuclidean' or a callable (bank, templates) -> M")
        if isinstance(cost, str) and cost not in ("neg_dot", "sqeuclidean"):
            raise ValueError(f"cost must be 'neg_dot' or 'sqeuclidean', got {cost!r}")
        gamma = math.sqrt(embed_dim) if gamma is None else gamma
        for name, val in (("alpha", alpha), ("gamma", gamma)):
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {val!r}")
        self.alpha, self.gamma, self.cost = float(alpha), float(gamma), cost
        self.query = nn.Parameter(torch.randn(1, 1, embed_dim) * embed_dim**-0.5)

    def forward(  # type: ignore[override]  # a pooling layer: tokens in, (B, E) out, not (q, k, v)
        self,
        tokens: Tensor,
        *,
        bank: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        bank_padding_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Pool ``tokens (B, N, E)`` (and optional extra ``bank (B, M, E)``) into ``(B, E)``."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 3 or tokens.shape[-1] != self.embed_dim:
            raise ValueError(f"tokens must be (B, N, E={self.embed_dim})")
        check_finite(tokens=tokens, bank=bank)
        b, n, _ = tokens.shape
        keep_t = _padding_to_keep(key_padding_mask, b, n, "key_padding_mask")
        z = self.split_heads(self.q_proj(self.query.expand(b, 1, -1).to(tokens.dtype)))
        templates = self.split_heads(self.k_proj(tokens))
        values = self.split_heads(self.v_proj(tokens))
        pref = None if keep_t is None else keep_t.to(tokens.dtype).unsqueeze(1)
        keep_bank = keep_t
        bank_k = None
        if bank is not None:
            if not isinstance(bank, Tensor) or bank.dim() != 3 or bank.shape[::2] != (b, self.embed_dim):
                raise ValueError(f"bank must be (B={b}, M, E={self.embed_dim})")
            keep_b = _padding_to_keep(bank_padding_mask, b, bank.shape[1], "bank_padding_mask")
            bank_k = torch.cat([templates, self.split_heads(self.k_proj(bank))], dim=-2)
            values = torch.cat([values, self.split_heads(self.v_proj(bank))], dim=-2)
            if keep_t is not None or keep_b is not None:
                dev = tokens.device
                kt = torch.ones(b, n, dtype=torch.bool, device=dev) if keep_t is None else keep_t
                kb = torch.ones(b, bank.shape[1], dtype=torch.bool, device=dev) if keep_b is None else keep_b
                keep_bank = torch.cat([kt, kb], 1)
        elif bank_padding_mask is not None:
            raise ValueError("bank_padding_mask given without a bank")
        mask = None if keep_bank is None else keep_bank.unsqueeze(1)
        kw: dict[str, Any] = dict(
            bank=bank_k, preference=pref, cost=self.cost, alpha=self.alpha, gamma=self.gamma, bank_mask=mask
        )
        out = ot_attention(z, templates, bank_values=values, dropout_p=self.dropout_p, **kw)  # (B, H, 1, d)
        pooled = self.out_proj(self.merge_heads(out)).squeeze(1)
        weights = ot_weights(z, templates, **kw).squeeze(-2) if need_weights else None
        return pooled, weights
