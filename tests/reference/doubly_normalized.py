"""Materialized float64 oracle for LNAS / DNAS / Sinkhorn-K / HNAS (tests only).

Follows the paper literally (doubly-normalized-attention eq. 6–8 and 10): start from
``exp(s_ij)`` (0 where masked), then K times: divide each column by its sum over queries,
divide each row by its sum over keys. Computed in the log domain; an all-masked column or
row stays at weight 0.
"""
from __future__ import annotations

import torch
from torch import Tensor


def scores_ref(q: Tensor, k: Tensor, scale: float | None = None, mask: Tensor | None = None,
               is_causal: bool = False) -> Tensor:
    """``scale <q_i,k_j> + m_ij`` with ``-inf`` for dropped pairs (bool mask: True = keep)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask
    if is_causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _normalize(logp: Tensor, dim: int) -> Tensor:
    """Subtract the log-sum-exp along ``dim``; an all ``-inf`` slice stays (no NaN gradient)."""
    empty = ~torch.isfinite(logp).any(dim=dim, keepdim=True)
    safe = torch.where(empty, torch.zeros_like(logp), logp)
    lse = torch.where(empty, torch.zeros_like(empty, dtype=logp.dtype), torch.logsumexp(safe, dim, True))
    return logp - lse


def sinkhorn_weights_ref(s: Tensor, iterations: int) -> Tensor:
    """Weights after ``iterations`` (column, row) normalizations; 0 = plain softmax (LNAS)."""
    logp = s
    for _ in range(iterations):
        logp = _normalize(logp, -2)
        logp = _normalize(logp, -1)
    if iterations == 0:
        logp = _normalize(logp, -1)
    return torch.exp(logp)


def attention_ref(q: Tensor, k: Tensor, v: Tensor, iterations: int = 1, *, scale: float | None = None,
                  mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    return sinkhorn_weights_ref(scores_ref(q, k, scale, mask, is_causal), iterations) @ v


def hybrid_ref(q: Tensor, k: Tensor, v: Tensor, weight: Tensor, iterations: int = 1, *,
               scale: float | None = None, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    s = scores_ref(q, k, scale, mask, is_causal)
    w = weight.reshape(-1, 1, 1) if weight.dim() == 1 else weight
    pi = w * sinkhorn_weights_ref(s, iterations) + (1 - w) * sinkhorn_weights_ref(s, 0)
    return pi @ v
