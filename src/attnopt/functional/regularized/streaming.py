r"""Blocked sparsemax / α-entmax attention that never keeps the ``Nq × Nk`` weights (internal).

Forward: for each block of queries, compute the scores, the map ``p = [(α−1)(s − max s) − θ]₊^{1/(α−1)}``
(``kernels.forward``, the implementation the router chose), ``out = p v``; keep only the per-query
thresholds ``θ``.
Backward: recompute the block's scores and ``p`` from ``θ`` (no iteration), then

.. math:: dV \mathrel{+}= p^\top dO,\quad dP = dO\,V^\top,\quad
          dS = g\odot(dP - \tfrac{\sum g\,dP}{\sum g}),\ g = p^{2-\alpha},\quad
          dQ = dS\,K\,\mathrm{scale},\quad dK \mathrel{+}= dS^\top Q\,\mathrm{scale}

Saved for backward: ``q, k, v``, the (non-differentiated) additive mask, the locality ``β``
and the thresholds — O(N·d) memory besides one block of scores at a time. On GPUs the Triton
kernels of :mod:`attnopt.functional.triton.sparse` do the same blockwise (routed by
``regularized_attention``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt.functional._autograd import double_backward, tracked_vjp
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.regularized._common import MapKernels, default_tol, map_from_threshold

__all__ = ["blocked_sparse_attention"]



def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _distance(i0: int, i1: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    pos_q = torch.arange(i0, i1, device=device)
    return (pos_q[:, None] - torch.arange(nk, device=device)[None, :]).abs().to(dtype)


def _block_scores(
    qb: Tensor, kc: Tensor, mask: Tensor | None, beta: Tensor | None, causal: bool, scale: float, i0: int
) -> Tensor:
    i1 = i0 + qb.shape[-2]
    nk = kc.shape[-2]
    s = torch.matmul(qb, kc.transpose(-2, -1)).mul_(scale)
    if mask is not None:
        s.add_(mask if mask.shape[-2] == 1 else mask[..., i0:i1, :])
    if beta is not None:
        dist = _distance(i0, i1, nk, beta.dtype, s.device)
        bias = -(beta * dist) if beta.dim() == 0 else -(beta.view(-1, 1, 1) * dist)
        s.add_(bias.to(s.dtype))
    if causal:
        rows = torch.arange(i0, i1, device=s.device)[:, None]
        s.masked_fill_(torch.arange(nk, device=s.device)[None, :] > rows, float("-inf"))
    return s


class _BlockedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        beta: Tensor | None,
        alpha: float,
        scale: float,
        causal: bool,
        block: int,
        kernels: MapKernels,
    ) -> tuple[Tensor, Tensor]:
        compute = _compute(q.dtype)
        tol = default_tol(compute)
        max_iter = 1000 if alpha == 2.0 else 100
        kc, vc = k.to(compute), v.to(compute)
        b = beta.detach() if beta is not None else None  # bias in the dtype of beta, as ALiBi
        nq = q.shape[-2]
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        thetas = torch.empty((*q.shape[:-1], 1), dtype=compute, device=q.device)
        for i0 in range(0, nq, block):
            qb = q[..., i0 : i0 + block, :].to(compute)
            s = _block_scores(qb, kc, mask, b, causal, scale, i0)
            p, theta = kernels.forward(s, alpha, -1, max_iter, tol)
            thetas[..., i0 : i0 + block, :] = theta
            out[..., i0 : i0 + block, :] = torch.matmul(p, vc).to(q.dtype)
        return out, thetas

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, mask, beta, alpha, scale, causal, block, kernels = inputs
        ctx.alpha, ctx.scale, ctx.causal, ctx.block, ctx.kernels = alpha, scale, causal, block, kernels
        ctx.save_for_backward(q, k, v, mask, beta, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dtheta: Tensor | None) -> tuple[Any, ...]:
        if double_backward(ctx):  # create_graph=True: the plain ops (exact double backward)
            args = (*ctx.saved_tensors[:5], ctx.alpha, ctx.scale, ctx.causal, 0, None)
            return tracked_vjp(ctx, lambda *a: ctx.kernels.tracked(*a[:8]), args, dout)
        q, k, v, mask, beta, thetas = ctx.saved_tensors
        compute = _compute(q.dtype)
        kc, vc = k.to(compute), v.to(compute)
        b = beta.detach() if beta is not None else None  # bias in the dtype of beta, as ALiBi
        want_beta = beta is not None and ctx.needs_input_grad[4]
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute, device=q.device)
        dv = torch.zeros(v.shape, dtype=compute, device=q.device)
        dbeta = torch.zeros(beta.shape, dtype=compute, device=q.device) if want_beta else None
        nq, nk = q.shape[-2], k.shape[-2]
        for i0 in range(0, nq, ctx.block):
            qb = q[..., i0 : i0 + ctx.block, :].to(compute)
            s = _block_scores(qb, kc, mask, b, ctx.causal, ctx.scale, i0)
            p = map_from_threshold(s, thetas[..., i0 : i0 + ctx.block, :], ctx.alpha, -1)
            do = dout[..., i0 : i0 + ctx.block, :].to(compute)
            dv.add_(torch.matmul(p.transpose(-2, -1), do))
            ds = ctx.kernels.backward(p, torch.matmul(do, vc.transpose(-2, -1)), ctx.alpha, -1)
            dq[..., i0 : i0 + ctx.block, :] = torch.matmul(ds, kc).mul_(ctx.scale)
            dk.add_(torch.matmul(ds.transpose(-2, -1), qb).mul_(ctx.scale))
            if dbeta is not None:
                dist = _distance(i0, i0 + qb.shape[-2], nk, compute, q.device)
                contrib = -(ds * dist).sum(dim=(-2, -1))
                if dbeta.dim() == 0:
                    dbeta.add_(contrib.sum())
                else:
                    dbeta.add_(contrib.reshape(-1, dbeta.shape[0]).sum(0))
        gb = dbeta.to(beta.dtype) if dbeta is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, gb, None, None, None, None, None


def blocked_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    alpha: float,
    scale: float,
    mask: Tensor | None,
    beta: Tensor | None,
    is_causal: bool,
    block_size: int | None,
    kernels: MapKernels,
) -> Tensor:
    """Sparsemax (``alpha = 2``) / α-entmax attention, blocked over queries (inputs validated).

    ``mask`` is additive (broadcastable to (B, H, Nq, Nk), not differentiated); ``beta`` is the
    locality, a 0-d or ``(H,)`` tensor (differentiated); ``kernels``: the map implementations the
    router chose.
    """
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    nq, nk = q.shape[-2], k.shape[-2]
    if block_size is None:
        rows = max(1, int(torch.tensor(batch).prod().item()) if batch else 1)
        block_size = max(1, min(nq, THRESHOLDS.sparse_streaming_block_elements // max(1, rows * nk)))
    if mask is not None:
        mask = mask.detach()
    out, _ = _BlockedSparseAttention.apply(q, k, v, mask, beta, alpha, scale, is_causal, block_size, kernels)
    return out
