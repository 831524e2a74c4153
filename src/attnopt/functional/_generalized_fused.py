r"""Fused softmax attention with a *differentiable* additive bias (internal).

fenchel-dual-attention eq. (16)–(18): ``O = softmax(scale·QKᵀ + b) V`` where ``b = log u + m``
requires grad (a learned T5 relative bias, a context-dependent preference). PyTorch's SDPA
then falls back to its math kernel (materialized, autograd through ~10 nodes); this path is
the same ``Nq × Nk`` memory with one autograd node and the closed-form backward

.. math:: dP = dO\,V^\top,\quad dS = P\odot(dP - \delta),\ \delta_i = \langle dO_i, O_i\rangle,\quad
          dQ = \mathrm{scale}\, dS\, K,\ dK = dS^\top(\mathrm{scale}\,Q),\ dV = P^\top dO,\
          db = \textstyle\sum_{\text{broadcast dims}} dS.

A row whose bias is ``-inf`` everywhere gets zeros (and zero gradients). Subnormal weights
are flushed to 0. Half precision is computed in float32.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["biased_softmax_attention"]


def _reduce_to(g: Tensor, shape: torch.Size) -> Tensor:
    lead = g.dim() - len(shape)
    if lead > 0:
        g = g.sum(tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True) if dims else g


class _BiasedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float
    ) -> Tensor:
        qs = q * scale
        s = torch.matmul(qs, k.transpose(-2, -1)).add_(bias)
        dead = torch.isneginf(s.amax(-1, keepdim=True))
        if bool(dead.any()):
            p = torch.softmax(s.masked_fill_(dead, 0.0), -1).masked_fill_(dead, 0.0)
        else:
            p = torch.softmax(s, -1)
        del s
        # flush subnormal weights (< 1.2e-38 in float32, e.g. far keys under ALiBi) to 0: they
        # change no sum at float precision, and subnormal arithmetic made the backward 2.4x slower
        p.masked_fill_(p < torch.finfo(p.dtype).tiny, 0.0)
        out = torch.matmul(p, v)
        ctx.scale = scale
        ctx.bias_shape = bias.shape
        ctx.save_for_backward(qs, k, v, p, out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qs, k, v, p, out = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        dv = torch.matmul(p.transpose(-2, -1), dout)
        delta = (dout * out).sum(-1, keepdim=True)
        ds = torch.matmul(dout, v.transpose(-2, -1)).sub_(delta).mul_(p)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), qs)
        db = _reduce_to(ds, ctx.bias_shape) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, db, None


def biased_softmax_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` (inputs validated; ``bias`` broadcastable to the scores)."""
    orig = q.dtype
    compute = torch.float32 if orig in (torch.float16, torch.bfloat16) else orig
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], bias.shape[:-2]))
    qkv = []
    for x in (q, k, v):
        x = x.to(compute)
        qkv.append(x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:]))
    out: Tensor = _BiasedSoftmax.apply(*qkv, bias.to(compute), scale)
    return out.to(orig)
