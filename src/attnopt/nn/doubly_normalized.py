"""Multi-head doubly-normalized (DNAS) and hybrid (HNAS) attention modules.

doubly-normalized-attention Sec. 3–6. Same call convention as
``torch.nn.MultiheadAttention(batch_first=True)`` (see :class:`attnopt.nn._multihead.MultiheadBase`);
the attention itself is :func:`attnopt.functional.doubly_normalized_attention` /
:func:`attnopt.functional.hybrid_normalized_attention`, O(N) memory with ``key_padding_mask``
(a full ``attn_mask`` is Nq × Nk by itself; so is the autoregressive variant below).

Causal use (decoders). A causal mask restricts the transport plan but does not make DNAS
autoregressive: the column normalization ``c_j = logsumexp_i s_ij`` runs over later queries too.
``module(x, is_causal=True)`` therefore runs the autoregressive ``causal="prefix"`` variant by
default (query ``i`` normalizes over queries ``≤ i``; materialized ``Nq × Nk``); the constructor's
``causal="plan"`` keeps the masked plan for analysis. A causal pattern given as ``attn_mask`` is
not recognised (its values are not read): pass ``is_causal=True`` or build with
``causal="prefix"``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
)
from attnopt.functional.doubly_normalized.prefix import Causal, resolve_causal
from attnopt.nn._multihead import MultiheadBase

__all__ = ["DoublyNormalizedMultiheadAttention", "HybridNormalizedMultiheadAttention"]


def _check_iterations(iterations: int, minimum: int) -> int:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < minimum:
        raise ValueError(f"iterations must be an int >= {minimum}, got {iterations!r}")
    return iterations


class DoublyNormalizedMultiheadAttention(MultiheadBase):
    """Multi-head DNAS / Sinkhorn-K attention (``iterations=0`` is ordinary attention).

    Args:
        embed_dim, num_heads, bias, kdim, vdim: as ``nn.MultiheadAttention``.
        dropout: dropout on the attention weights in training mode (as ``nn.MultiheadAttention``;
            such calls materialize the ``Nq × Nk`` weights, :mod:`attnopt.functional._dropout`).
        iterations: K Sinkhorn (column, row) steps; 1 = DNAS.
        causal: ``None`` (default: the autoregressive ``"prefix"`` variant when called with
            ``is_causal=True``, the ordinary plan otherwise), ``"prefix"`` (always normalize over
            the queries up to each row, e.g. a decoder's cross-attention over a source) or
            ``"plan"`` (the mask only restricts the plan; leaks later queries under a causal
            mask). See :func:`attnopt.functional.doubly_normalized_attention`.
    Raises:
        ValueError: bad sizes, ``iterations < 0`` or an unknown ``causal``.
    """

    couples_queries = True  # the column normalization runs over queries

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        iterations: int = 1,
        causal: Causal | None = None,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        self.iterations = _check_iterations(iterations, 0)
        resolve_causal(causal, False)  # validates
        self.causal = causal

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        out = doubly_normalized_attention(q, k, v, iterations=self.iterations, attn_mask=mask,
                                          is_causal=is_causal, causal=self.causal, dropout_p=self.dropout_p)
        weights = None
        if need_weights:
            weights = doubly_normalized_weights(q, k, iterations=self.iterations, attn_mask=mask,
                                                is_causal=is_causal, causal=self.causal)
        return out, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, iterations={self.iterations}, "
                f"causal={self.causal!r}")


class HybridNormalizedMultiheadAttention(MultiheadBase):
    """Multi-head HNAS: ``w · DNAS + (1 − w) · LNAS`` with a learned ``w = sigmoid(θ)`` (Sec. 6).

    One scalar per layer as in the paper (``per_head=True``: one per head).
    :attr:`mixing_weight` gives the current ``w`` (detached) for plotting.

    Args:
        embed_dim, num_heads, bias, kdim, vdim: as ``nn.MultiheadAttention``.
        dropout: dropout on the attention weights in training mode (as ``nn.MultiheadAttention``;
            such calls materialize the ``Nq × Nk`` weights, :mod:`attnopt.functional._dropout`).
        iterations: Sinkhorn steps of the doubly-normalized term (>= 1).
        init_weight: initial ``w`` in (0, 1).
        per_head: learn one ``w`` per head instead of one per layer.
        causal: as :class:`DoublyNormalizedMultiheadAttention` (``"prefix"`` mixes the
            autoregressive DNAS rows with the causal softmax).
    Raises:
        ValueError: bad sizes, ``iterations < 1``, ``init_weight`` not in (0, 1) or an unknown
            ``causal``.
    """

    couples_queries = True  # the column normalization runs over queries

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        iterations: int = 1,
        init_weight: float = 0.5,
        per_head: bool = False,
        causal: Causal | None = None,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        self.iterations = _check_iterations(iterations, 1)
        resolve_causal(causal, False)  # validates
        self.causal = causal
        if not 0.0 < float(init_weight) < 1.0:
            raise ValueError(f"init_weight must lie in (0, 1), got {init_weight}")
        logit = math.log(init_weight / (1.0 - init_weight))
        self.weight_logit = nn.Parameter(torch.full((num_heads,) if per_head else (), logit))

    @property
    def mixing_weight(self) -> Tensor:
        """Current ``w = sigmoid(θ)`` (a 0-d tensor, or ``(H,)``), detached."""
        return torch.sigmoid(self.weight_logit.detach())

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        w = torch.sigmoid(self.weight_logit).to(q.dtype)
        out = hybrid_normalized_attention(q, k, v, w, iterations=self.iterations, attn_mask=mask,
                                          is_causal=is_causal, causal=self.causal, dropout_p=self.dropout_p)
        weights = None
        if need_weights:
            weights = hybrid_normalized_weights(q, k, w, iterations=self.iterations, attn_mask=mask,
                                                is_causal=is_causal, causal=self.causal)
        return out, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, iterations={self.iterations}, "
                f"per_head={self.weight_logit.dim() == 1}, causal={self.causal!r}")
