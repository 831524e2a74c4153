r"""Softmax attention with an additive bias: two fused CPU paths (internal).

fenchel-dual-attention eq. (16)–(18): ``O = softmax(scale·QKᵀ + b) V`` with ``b = log u + m``
(a T5 relative bias, ALiBi, masks).

* :func:`biased_softmax_attention` — *materialized*, one autograd node, and the only path
  with a gradient for ``b`` (a learned T5 bias). Works through the batch·head dimension in
  chunks whose ``Nq × Nk`` score block fits the L2 cache (:data:`CHUNK_BYTES`): the score,
  softmax and ``dP``/``dS`` passes run in cache (at B·H = 8, N = 512 the forward took 6 ms
  chunked vs 14 ms on the whole tensor). Closed-form backward

  .. math:: dP = dO\,V^\top,\quad dS = P\odot(dP - \delta),\ \delta_i = \langle dO_i, O_i\rangle,\quad
            dQ = \mathrm{scale}\, dS\, K,\ dK = dS^\top(\mathrm{scale}\,Q),\ dV = P^\top dO,\
            db = \textstyle\sum_{\text{broadcast dims}} dS.

  Where the native kernels run (CPU float32/64, a C compiler, ``ATTNOPT_NATIVE`` not ``0``,
  tensors with storage) the same node runs its elementwise passes in C
  (:mod:`._generalized_native`); the PyTorch version here is the fallback.

* :func:`biased_flash_attention` — *streaming*: PyTorch's fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) with the bias as
  its float mask, O(N) memory beyond the bias; no gradient for the bias.

Both run with subnormals flushed to zero (:mod:`._denormal`): under ALiBi most far keys
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
from attnopt.functional import _generalized_native
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal
from attnopt.functional._toeplitz import toeplitz_offsets

__all__ = ["biased_softmax_attention", "biased_flash_attention", "flash_bias_available", "CHUNK_BYTES"]

#: Bytes of one chunk's ``Nq × Nk`` score block (half this machine's 2 MiB L2: ``dP`` sits beside it).
CHUNK_BYTES = 1 << 20
#: Largest ``B·H·Nq·Nk`` bytes of ``P`` always saved for the backward; above, it is recomputed
#: per chunk when the head dimension is below 64.
SAVE_BYTES = 1 << 24

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _chunks(b: int, h: int, block: int, on_host: bool = True) -> Iterator[tuple[slice, slice]]:
    """(batch, head) slices covering ``b × h`` with about ``CHUNK_BYTES / block`` score blocks each.

    One chunk (the whole batch) unless ``on_host`` (a CPU tensor outside ``torch.compile``): the
    cache-sized chunks are a CPU optimization; on another device they would be a Python loop over
    batch × heads (a kernel launch per op per chunk)."""
    if not on_host:
        yield slice(0, b), slice(0, h)
        return
    per = max(1, CHUNK_BYTES // max(block, 1))
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

    ``P`` is saved for the backward up to :data:`SAVE_BYTES` and, for head dimensions below 64,
    recomputed chunk by chunk above (a large fresh buffer, written once and read once, cost more
    than the recompute)."""

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
        save = b * h * block <= SAVE_BYTES or d >= 64
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


class _FlashBias(torch.autograd.Function):
    """The CPU flash kernel with a constant float mask, subnormals flushed (no bias gradient)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float
    ) -> Tensor:
        with flush_denormal():
            out, lse = _fwd(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        q, k, v, bias, out, lse = ctx.saved_tensors
        with flush_denormal():
            dq, dk, dv = _bwd(dout.to(q.dtype).contiguous(), q, k, v, out, lse, 0.0, False,
                              attn_mask=bias, scale=ctx.scale)
        return dq, dk, dv, None, None


def _batched(
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


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def biased_softmax_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V``, materialized in L2-sized chunks (inputs validated)."""
    orig, compute = q.dtype, _compute_dtype(q)
    offsets = toeplitz_offsets(bias)  # a relative-position bias's values per offset j − i, or None
    qkv = q.to(compute), k.to(compute), v.to(compute)
    lib = _generalized_native.library(*qkv, bias) if all(x.numel() for x in qkv) else None
    # the C path takes q, k, v of any strides (they are copied into its own layout anyway)
    (qc, kc, vc), b4, batch = _batched(*qkv, bias.to(compute), contiguous=lib is None)
    if lib is not None:  # the elementwise passes in C (see _generalized_native)
        if len(batch) != 2:
            offsets = None  # heads flattened: no longer one row of offsets per head
        out: Tensor = _generalized_native.native_biased_softmax(lib, qc, kc, vc, b4, scale, offsets)
    else:
        out = _BiasedSoftmax.apply(qc, kc, vc, b4, scale)
    shape = (*batch, q.shape[-2], v.shape[-1])
    if out.shape != shape:  # (a reshape to the same shape is an autograd node too)
        out = out.reshape(shape)
    return out.to(orig)


def flash_bias_available(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> bool:
    """Whether :func:`biased_flash_attention` takes these inputs.

    CPU, float32/64, 4-D inputs of one batch shape, ``d = dv``, a bias without gradient.
    """
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == v.shape[-1]
            and not bias.requires_grad)


def biased_flash_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` by the fused CPU flash kernel (see :func:`flash_bias_available`)."""
    qkv = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # the kernel's layout contract
    b = bias.to(q.dtype)
    if b.dim() < 4:
        b = b.reshape((1,) * (4 - b.dim()) + tuple(b.shape))
    if b.stride(-1) != 1 and b.shape[-1] > 1:
        b = b.contiguous()
    out: Tensor = _FlashBias.apply(*qkv, b, scale)
    return out
