r"""Fused materialized sparsemax / α-entmax attention for short sequences (internal).

sdpa-one-sided-eot Prop. 4.2–4.3. Scores ``S = (scale·Q)Kᵀ + M − β|i−j|`` are formed once,
the row thresholds are found on them by the threshold search of
:mod:`attnopt.functional.entmax` (Michelot/Newton, exact for α = 2 and 1.5), and
``P = [(α−1)(S − max S) − θ]₊^{1/(α−1)}``, ``O = P V``. Against the blocked path this saves the
per-block bookkeeping and, in the backward, the recomputation of ``S`` and ``P``.

(A sort-based exact threshold on the compacted candidates ``z > −1`` was tried: ``torch.sort``
and the compaction ops are slower on CPU than the dense Newton passes at these sizes.)

Backward saves ``P`` (no recomputation): ``dP = dO Vᵀ``, ``dS = g ⊙ (dP − Σ g dP / Σ g)``
with ``g = p^{2−α}`` (the support indicator for sparsemax), ``dQ = scale·dS K``,
``dK = dSᵀ (scale·Q)``, ``dV = Pᵀ dO``, ``dβ = −Σ dS ⊙ |i − j|``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt.functional.entmax import _default_tol, _entmax_backward, _threshold_map

__all__ = ["fused_sparse_attention"]


def _distance(nq: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    pos = torch.arange(nq, device=device)[:, None] - torch.arange(nk, device=device)[None, :]
    return pos.abs().to(dtype)


def _scores(qs: Tensor, k: Tensor, mask: Tensor | None, beta: Tensor | None, causal: bool) -> Tensor:
    s = torch.matmul(qs, k.transpose(-2, -1))
    nq, nk = s.shape[-2], s.shape[-1]
    if mask is not None:
        s.add_(mask)
    if beta is not None:
        dist = _distance(nq, nk, beta.dtype, s.device)
        bias = beta * dist if beta.dim() == 0 else beta.view(-1, 1, 1) * dist
        s.sub_(bias.to(s.dtype))
    if causal:
        s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _sparse_map(s: Tensor, alpha: float) -> Tensor:
    """``P`` from the scores ``s (…, Nq, Nk)`` (the threshold search of :mod:`.entmax`)."""
    max_iter = 1000 if alpha == 2.0 else 100
    return _threshold_map(s, alpha, -1, max_iter, _default_tol(s.dtype))[0]


class _FusedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, beta: Tensor | None, alpha: float,
        scale: float, causal: bool,
    ) -> Tensor:
        qs = q * scale
        b = beta.detach() if beta is not None else None
        p = _sparse_map(_scores(qs, k, mask, b, causal), alpha)
        ctx.alpha, ctx.scale = alpha, scale
        ctx.save_for_backward(qs, k, v, p, beta)
        return torch.matmul(p, v)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qs, k, v, p, beta = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        dv = torch.matmul(p.transpose(-2, -1), dout)
        ds = _entmax_backward(p, torch.matmul(dout, v.transpose(-2, -1)), ctx.alpha, -1)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), qs)
        dbeta = None
        if beta is not None and ctx.needs_input_grad[4]:
            dist = _distance(p.shape[-2], p.shape[-1], ds.dtype, ds.device)
            per = -(ds * dist).sum((-2, -1))
            dbeta = per.sum() if beta.dim() == 0 else per.reshape(-1, beta.shape[0]).sum(0)
            dbeta = dbeta.to(beta.dtype)
        return dq, dk, dv, None, dbeta, None, None, None


def fused_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, alpha: float, scale: float, mask: Tensor | None, beta: Tensor | None,
    is_causal: bool,
) -> Tensor:
    """Sparsemax (``alpha = 2``) / α-entmax attention on materialized scores (inputs validated).

    Same contract as :func:`attnopt.functional._blocked_sparse.blocked_sparse_attention`.
    """
    orig = q.dtype
    compute = torch.float32 if orig in (torch.float16, torch.bfloat16) else orig
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    qkv = []
    for x in (q, k, v):
        x = x.to(compute)
        qkv.append(x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:]))
    m = None if mask is None else mask.detach().to(compute)
    out: Tensor = _FusedSparseAttention.apply(*qkv, m, beta, alpha, scale, is_causal)
    return out.to(orig)
