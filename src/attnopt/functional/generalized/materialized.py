r"""Softmax attention with an additive bias, materialized in cache-sized chunks (internal).

fenchel-dual-attention eq. (16)–(18): ``O = softmax(scale·QKᵀ + b) V`` with ``b = log u + m``
(a T5 relative bias, ALiBi, masks).

One autograd node (:class:`_BiasedSoftmax`), and the only path
with a gradient for ``b`` (a learned T5 bias). Works through the batch·head dimension in
chunks whose ``Nq × Nk`` score block fits the L2 cache (``THRESHOLDS.generalized_chunk_bytes``): the score,
softmax and ``dP``/``dS`` passes run in cache (at B·H = 8, N = 512 the forward took 6 ms
chunked vs 14 ms on the whole tensor). Closed-form backward

.. math:: dP = dO\,V^\top,\quad dS = P\odot(dP - \delta),\ \delta_i = \langle dO_i, O_i\rangle,\quad
          dQ = \mathrm{scale}\, dS\, K,\ dK = dS^\top(\mathrm{scale}\,Q),\ dV = P^\top dO,\
          db = \textstyle\sum_{\text{broadcast dims}} dS.

Where the native kernels run (CPU float32/64, a C compiler, ``ATTNOPT_NATIVE`` not ``0``,
tensors with storage) the router runs the same node with its elementwise passes in C
(:mod:`.cpu`); the PyTorch version here is the fallback.

It runs with subnormals flushed to zero (:mod:`attnopt.functional._denormal`): under ALiBi most far keys
have subnormal weights, which made SDPA's backward with the same mask 2.5× slower.
A row whose bias is ``-inf`` everywhere gets zeros (and zero gradients). Half precision is
computed in float32.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from attnopt._validation import broadcast_shapes, host_readable
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["batched", "biased_softmax_node", "compute_dtype"]


def _chunks(b: int, h: int, block: int, on_host: bool = True) -> Iterator[tuple[slice, slice]]:
    """(batch, head) slices covering ``b × h`` with about ``generalized_chunk_bytes / block`` score blocks.

    One chunk (the whole batch) unless ``on_host`` (a CPU tensor outside ``torch.compile``): the
    cache-sized chunks are a CPU optimization; on another device they would be a Python loop over
    batch × heads (a kernel launch per op per chunk)."""
    if not on_host:
        yield slice(0, b), slice(0, h)
        return
    per = max(1, THRESHOLDS.generalized_chunk_bytes // max(block, 1))
    if per >= h:
        nb = per // h
        for b0 in range(0, b, nb):
            yield slice(b0, min(b, b0 + nb)), slice(0, h)
    else:
        for b0 in range(b):
            for h0 in range(0, h, per):
                yield slice(b0, b0 + 1), slice(h0, min(h, h0 + per))


def _flat(bs: slice, hs: slice, h: int) -> slice:
    """The rows of a ``(B·H, …)`` view that the (batch, head) chunk covers (contiguous by construction)."""
    return slice(bs.start * h + hs.start, (bs.stop - 1) * h + hs.stop)


def _probabilities(
    s: Tensor, q3: Tensor, k3: Tensor, bc: Tensor, dead: Tensor | None, hs: slice, nq: int, nk: int
) -> Tensor:
    """One chunk's softmax weights ``P = softmax(QKᵀ + bias)`` into ``s`` (rows in ``dead``: 0)."""
    if bc.shape[0] == 1:  # one batch row: the bias (broadcast as it is) enters the matmul
        torch.baddbmm(bc[0], q3, k3.transpose(1, 2), out=s)
    else:  # several batch rows (short sequences): add it after
        torch.bmm(q3, k3.transpose(1, 2), out=s)
        s.view(-1, hs.stop - hs.start, nq, nk).add_(bc)
    torch.ops.aten._softmax.out(s, -1, False, out=s)
    if dead is not None:
        s.view(-1, hs.stop - hs.start, nq, nk).masked_fill_(dead, 0.0)
    return s


class _BiasedSoftmax(torch.autograd.Function):
    """q, k, v: contiguous (B, H, N, ·); bias: 4-D, broadcastable to (B, H, Nq, Nk).

    ``P`` is saved for the backward up to ``THRESHOLDS.generalized_save_bytes`` and, for head
    dimensions below 64, recomputed chunk by chunk above (a large fresh buffer, written once and
    read once, cost more than the recompute)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float
    ) -> Tensor:
        b, h, nq, d = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        qs = q * scale
        block = nq * nk * q.element_size()
        # recompute only where its matmul is cheap: at d = 16 (B·H = 128, N = 512) it cut the node
        # from 2.1× to 1.8× SDPA; at d = 64 (B·H = 64, N = 512) saving was as fast (1.24× vs 1.29×)
        save = b * h * block <= THRESHOLDS.generalized_save_bytes or d >= 64
        on_host = host_readable(q)
        chunks = list(_chunks(b, h, block, on_host))
        rows = max(_flat(bs, hs, h).stop - _flat(bs, hs, h).start for bs, hs in chunks)
        p = q.new_empty(b, h, nq, nk) if save else q.new_empty(rows, nq, nk)
        out = q.new_empty(b, h, nq, dv)
        q3, k3, v3 = qs.view(b * h, nq, d), k.view(b * h, nk, d), v.view(b * h, nk, dv)
        p3, o3 = p.view(-1, nq, nk), out.view(b * h, nq, dv)
        be = bias.expand(b, h, nq, nk)
        with flush_denormal(q):
            for bs, hs in chunks:
                f = _flat(bs, hs, h)
                s = p3[f] if save else p3[: f.stop - f.start]
                _probabilities(s, q3[f], k3[f], be[bs, hs], None, hs, nq, nk)
                torch.bmm(s, v3[f], out=o3[f])
        # checked after the fact, on the small output: with finite q, k, v, a NaN means a row with
        # no admissible key (softmax of all -inf) or NaN / +inf in the bias — one pass over the
        # bias only then, instead of its row maxima (an Nq×Nk pass) and a value check every call.
        # One sum (a non-finite total also when it merely overflows: then nothing is found below);
        # isnan().any() was 30× slower
        dead = None
        if not on_host:  # no host read: rows with no admissible key selected on the device
            dead = torch.isneginf(bias.amax(-1, keepdim=True)).expand(b, h, nq, 1)
            if save:
                p.masked_fill_(dead, 0.0)
            out.masked_fill_(dead, 0.0)
        elif not math.isfinite(float(out.sum())):
            top = bias.amax(-1, keepdim=True)
            if not bool(top.max() < float("inf")):
                raise ValueError("log_preference must not contain NaN or +inf (-inf masks a key)")
            dead = torch.isneginf(top).expand(b, h, nq, 1)
            if save:
                p.masked_fill_(dead, 0.0)  # rows with no admissible key: zero weights, output, gradients
            out.masked_fill_(dead, 0.0)
        ctx.scale = scale
        ctx.bias_shape = bias.shape
        ctx.save_for_backward(qs, k, v, p if save else None, out, bias if not save else None, dead)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        qs, k, v, p, out, bias, dead = ctx.saved_tensors
        b, h, nq, d = qs.shape
        nk, dv = k.shape[-2], v.shape[-1]
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        delta = (dout * out).sum(-1, keepdim=True).view(b * h, nq, 1)
        dq, dk, dvv = torch.empty_like(qs), torch.empty_like(k), torch.empty_like(v)
        bh = b * h
        q3, k3, v3 = qs.view(bh, nq, d), k.view(bh, nk, d), v.view(bh, nk, dv)
        do3, dq3 = dout.view(bh, nq, dv), dq.view(bh, nq, d)
        dk3, dv3 = dk.view(bh, nk, d), dvv.view(bh, nk, dv)
        bshape = ctx.bias_shape
        gb = qs.new_empty(bshape[0], bshape[1], nq, nk) if ctx.needs_input_grad[3] else None
        # a bias of the full batch shape (B = 1 with a (1, H, …) T5 bias): dS is written into its
        # gradient directly, no copy
        own = gb is not None and tuple(bshape[:2]) == (b, h)
        chunks = list(_chunks(b, h, nq * nk * qs.element_size(), host_readable(qs)))
        rows = max(_flat(bs, hs, h).stop - _flat(bs, hs, h).start for bs, hs in chunks)
        scratch = gb.view(bh, nq, nk) if own and gb is not None else qs.new_empty(rows, nq, nk)  # dS
        p3 = p.view(bh, nq, nk) if p is not None else qs.new_empty(rows, nq, nk)  # recomputed per chunk
        be = None if bias is None else bias.expand(b, h, nq, nk)
        with flush_denormal(qs):
            for bs, hs in chunks:
                f = _flat(bs, hs, h)
                if be is None:
                    pf = p3[f]
                else:
                    pf = _probabilities(p3[: f.stop - f.start], q3[f], k3[f], be[bs, hs],
                                        None if dead is None else dead[bs, hs], hs, nq, nk)
                torch.bmm(pf.transpose(1, 2), do3[f], out=dv3[f])
                part = f if own else slice(0, f.stop - f.start)
                # dS = (dO Vᵀ − δ) ⊙ P, the − δ inside the matmul (beta = −1)
                ds = torch.baddbmm(delta[f], do3[f], v3[f].transpose(1, 2), beta=-1.0, out=scratch[part])
                ds.mul_(pf)
                torch.bmm(ds, k3[f], out=dq3[f])
                torch.bmm(ds.transpose(1, 2), q3[f], out=dk3[f])
                if gb is not None and not own:
                    g = ds.view(-1, hs.stop - hs.start, nq, nk)
                    if bshape[0] == 1 and g.shape[0] > 1:
                        g = g.sum(0, keepdim=True)
                    if bshape[1] == 1 and g.shape[1] > 1:
                        g = g.sum(1, keepdim=True)
                    dst = gb[bs if bshape[0] != 1 else slice(0, 1), hs if bshape[1] != 1 else slice(0, 1)]
                    first = (bshape[0] != 1 or bs.start == 0) and (bshape[1] != 1 or hs.start == 0)
                    dst.copy_(g) if first else dst.add_(g)
        dq.mul_(ctx.scale)
        db = None
        if gb is not None:
            dims = tuple(i for i in (2, 3) if bshape[i] == 1)
            db = gb.sum(dims, keepdim=True) if dims else gb
        return dq, dk, dvv, db, None


def batched(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, contiguous: bool = True
) -> tuple[tuple[Tensor, ...], Tensor, tuple[int, ...]]:
    """q, k, v as (B, H, N, ·) of one batch shape (contiguous unless told) and ``bias`` 4-D
    (views unless needed)."""
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], bias.shape[:-2])
    if len(batch) != 2:  # any other batch rank: one flat head dimension
        bias = bias.expand(*batch, *bias.shape[-2:]).reshape(1, -1, *bias.shape[-2:])
        qkv = tuple(x.expand(*batch, *x.shape[-2:]).reshape(1, -1, *x.shape[-2:]).contiguous()
                    for x in (q, k, v))
    else:
        # an expand to the same shape is still an autograd node (~10 µs fwd+bwd at N = 64): skip it
        qkv = tuple(x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
        if contiguous:
            qkv = tuple(x.contiguous() for x in qkv)
    if bias.dim() < 4:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    return qkv, bias, batch


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def biased_softmax_node(qc: Tensor, kc: Tensor, vc: Tensor, b4: Tensor, scale: float) -> Tensor:
    """The PyTorch node on the prepared inputs of :func:`batched` (contiguous ``(B, H, N, ·)``,
    ``b4`` 4-D); ``(B, H, Nq, dv)``."""
    out: Tensor = _BiasedSoftmax.apply(qc, kc, vc, b4, scale)
    return out
