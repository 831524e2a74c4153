r"""Softmax attention with an additive bias, elementwise passes in C (internal; ``_native/biased_softmax.c``).

The same math and chunking as :class:`._generalized_fused._BiasedSoftmax`
(fenchel-dual-attention eq. (16)–(18), ``O = softmax(scale·QKᵀ + b) V``), with every
``Nq × Nk`` elementwise pass of a chunk in one C call that works row by row while the row is in
L1, and the bias read where it lies (a T5 bias ``(1, H, Nq, Nk)`` is shared by the batch: no
copy per chunk):

* forward: ``S = (scale·Q) Kᵀ`` (``bmm``); in C, per row: ``x = S + b``, its maximum ``m``,
  ``E = exp(x − m)``, ``r = 1 / Σ E``; ``out = r ⊙ (E V)`` (the normalization on the small
  output instead of an ``Nq × Nk`` pass). Saved: ``m`` and ``r`` (O(N) per head), and ``E``
  itself up to :data:`._generalized_fused.SAVE_BYTES` or at ``d ≥ 64`` (as the PyTorch path);
* backward: with ``dO' = r ⊙ dO``: ``dP' = dO' Vᵀ`` (``bmm``) and, where ``E`` was not saved,
  ``S`` again; in C, per row: ``E`` (bitwise as in the forward), ``dS = E ⊙ (dP' − r δ)``
  ``= P ⊙ (dP − δ)``, ``δ_i = <dO_i, O_i>``, and the bias gradient ``db += dS`` summed over the
  bias's broadcast batch / head dims in the same pass; then ``dV = Eᵀ dO'``,
  ``dQ = scale·dS K``, ``dK = dSᵀ(scale·Q)``.

Rows whose bias is ``-inf`` everywhere get zeros and zero gradients; NaN or ``+inf`` in the
bias raise (the C pass counts such rows). Weights and ``dS`` below the smallest normal
number are flushed to zero (as the PyTorch path does with the CPU's FTZ mode). float32's
exponential is a polynomial (about 2 ulp, see ``dnas.c``), float64's is libm's.

A chunk holds about :data:`CHUNK_BYTES` of scores per thread; its query rows are split over
``torch.get_num_threads()`` threads (:func:`attnopt._native.parallel_rows`), so threads write
disjoint rows of the bias gradient.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal

__all__ = ["CHUNK_BYTES", "library", "native_biased_softmax"]

#: Bytes of scores per thread in one chunk: ``S`` and ``dP`` of the backward share the 2 MiB L2.
CHUNK_BYTES = 1 << 20

_I64, _INT = ctypes.c_int64, ctypes.c_int
_p = _native.pointer


def library(q: Tensor, bias: Tensor) -> ctypes.CDLL | None:
    """The compiled ``biased_softmax.c`` when the native path applies, else ``None``.

    CPU float32/64 tensors with storage (not ``torch.func`` / fake tensors), a bias whose key
    dimension is full (a bias constant along keys cancels; the PyTorch path takes it).
    """
    if (q.dtype not in (torch.float32, torch.float64) or q.device.type != "cpu"
            or not _native.has_storage(q, bias) or bias.dtype != q.dtype or bias.device != q.device):
        return None
    return _native.library("biased_softmax")


def _chunks(g: int, block: int) -> list[tuple[int, int]]:
    """Flat head ranges ``[h0, h1)`` of about ``CHUNK_BYTES`` per thread."""
    step = max(1, CHUNK_BYTES * max(1, torch.get_num_threads()) // max(block, 1))
    return [(h, min(h + step, g)) for h in range(0, g, step)]


def _strides(t: Tensor | None) -> tuple[ctypes.c_int64, ...]:
    """Batch, head and row strides of a 4-D tensor in elements, 0 along size-1 dims."""
    if t is None:
        return _I64(0), _I64(0), _I64(0)
    return tuple(_I64(0 if t.shape[i] == 1 else t.stride(i)) for i in range(3))


def _layout(t: Tensor, toeplitz: bool, nq: int) -> tuple[ctypes.c_void_p, tuple[ctypes.c_int64, ...]]:
    """The C kernel's bias pointer and (batch, head, row) strides for ``t``.

    A Toeplitz bias's row ``i`` of head ``h`` starts at ``offsets[h, Nq − 1 − i]``: the pointer
    to ``offsets[0, Nq − 1]`` and row stride −1."""
    if not toeplitz:
        return ctypes.c_void_p(t.data_ptr()), _strides(t)
    ptr = ctypes.c_void_p(t.data_ptr() + (nq - 1) * t.element_size())
    return ptr, (_I64(0), _I64(0 if t.shape[0] == 1 else t.stride(0)), _I64(-1))


class _NativeBiasedSoftmax(torch.autograd.Function):
    """q, k, v: contiguous (B, H, N, ·); bias: 4-D (B|1, H|1, Nq|1, Nk) with unit key stride, or
    (``toeplitz``) contiguous per-offset values (H|1, Nq + Nk − 1) of a bias (1, H|1, Nq, Nk)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, lib: ctypes.CDLL,
        toeplitz: bool,
    ) -> Tensor:
        from attnopt.functional._generalized_fused import SAVE_BYTES

        b, h, nq, d = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        g = b * h
        qs = q * scale
        block = nq * nk * q.element_size()
        save = g * block <= SAVE_BYTES or d >= 64  # as the PyTorch path (see _BiasedSoftmax)
        parts = _chunks(g, block)
        size = parts[0][1] - parts[0][0]
        p = q.new_empty(g if save else size, nq, nk)
        mx, rinv = q.new_empty(g, nq), q.new_empty(g, nq)
        out = q.new_empty(g, nq, dv)
        q3, k3, v3 = qs.view(g, nq, d), k.view(g, nk, d), v.view(g, nk, dv)
        fwd = lib.bs_fwd_f64 if q.dtype == torch.float64 else lib.bs_fwd_f32
        fwd.restype = ctypes.c_int64
        base, (sb, sh, si) = _layout(bias, toeplitz, nq)
        bad = [0]
        with flush_denormal():
            for h0, h1 in parts:
                s = p[h0:h1] if save else p[: h1 - h0]
                torch.bmm(q3[h0:h1], k3[h0:h1].transpose(1, 2), out=s)

                def rows(i0: int, i1: int, s: Tensor = s, h0: int = h0, h1: int = h1) -> None:
                    bad[0] += fwd(_p(s), base, sb, sh, si, _p(mx), _p(rinv), _I64(h0), _I64(h1), _I64(h),
                                  _I64(i0), _I64(i1), _I64(nq), _I64(nk))

                _native.parallel_rows(rows, nq, (h1 - h0) * nk)
                torch.bmm(s, v3[h0:h1], out=out[h0:h1])
        out.mul_(rinv.unsqueeze(-1))
        if bad[0]:  # q and k are finite (validated): NaN or +inf came from the bias
            if not bool(bias.amax(-1).max() < float("inf")):
                raise ValueError("log_preference must not contain NaN or +inf (-inf masks a key)")
            raise ValueError("the biased scores overflowed to +inf")
        ctx.scale = scale
        ctx.lib, ctx.toeplitz = lib, toeplitz
        ctx.save_for_backward(qs, k, v, p if save else None, out, bias, mx, rinv)
        return out.view(b, h, nq, dv)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        qs, k, v, p, out, bias, mx, rinv = ctx.saved_tensors
        b, h, nq, d = qs.shape
        nk, dv = k.shape[-2], v.shape[-1]
        g = b * h
        lib = ctx.lib
        do3 = dout.to(v.dtype).reshape(g, nq, dv)
        delta = (do3 * out).sum(-1).mul_(rinv)  # r δ, (g, nq)
        do3 = do3 * rinv.unsqueeze(-1)  # dO' = r dO (contiguous)
        q3, k3, v3 = qs.view(g, nq, d), k.view(g, nk, d), v.view(g, nk, dv)
        dq, dk, dvv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        toeplitz = ctx.toeplitz
        # the bias gradient: in place of the bias (threads write disjoint rows), or for a Toeplitz
        # bias one (H, Nq + Nk − 1) buffer of diagonal sums per thread (rows share offsets)
        gb = bias.new_zeros(bias.shape) if ctx.needs_input_grad[3] and not toeplitz else None
        parts_t: dict[int, Tensor] = {}
        need_t = ctx.needs_input_grad[3] and toeplitz
        block = nq * nk * qs.element_size()
        parts = _chunks(g, block)
        size = parts[0][1] - parts[0][0]
        recompute = p is None
        s_buf = qs.new_empty(size, nq, nk) if recompute else None
        dp_buf = qs.new_empty(size, nq, nk)
        bwd = lib.bs_bwd_f64 if qs.dtype == torch.float64 else lib.bs_bwd_f32
        base, (sb, sh, si) = _layout(bias, toeplitz, nq)
        gbase, (gsb, gsh, gsi) = (None, _strides(None)) if gb is None else _layout(gb, False, nq)
        if need_t:
            gsb, gsh, gsi = sb, sh, si
        # a bias broadcast over query rows: every row adds into the same gradient row (one thread)
        one = gb is not None and gb.shape[2] == 1 and nq > 1
        with flush_denormal():
            for h0, h1 in parts:
                if s_buf is not None:
                    s = torch.bmm(q3[h0:h1], k3[h0:h1].transpose(1, 2), out=s_buf[: h1 - h0])
                else:
                    s = p[h0:h1]
                dp = torch.bmm(do3[h0:h1], v3[h0:h1].transpose(1, 2), out=dp_buf[: h1 - h0])

                def rows(i0: int, i1: int, s: Tensor = s, dp: Tensor = dp, h0: int = h0, h1: int = h1
                         ) -> None:
                    gp = gbase
                    if need_t:  # this row range's own buffer (the same range in every chunk)
                        buf = parts_t.get(i0)
                        if buf is None:
                            buf = parts_t.setdefault(i0, bias.new_zeros(bias.shape))
                        gp = _layout(buf, True, nq)[0]
                    bwd(_p(s), _p(dp), _INT(int(recompute)), base, sb, sh, si, _p(mx), _p(rinv), _p(delta),
                        gp, gsb, gsh, gsi, _I64(h0), _I64(h1), _I64(h), _I64(i0), _I64(i1), _I64(nq),
                        _I64(nk))

                if one:
                    rows(0, nq)
                else:
                    _native.parallel_rows(rows, nq, (h1 - h0) * nk)
                torch.bmm(s.transpose(1, 2), do3[h0:h1], out=dvv[h0:h1])
                torch.bmm(dp, k3[h0:h1], out=dq[h0:h1])
                torch.bmm(dp.transpose(1, 2), q3[h0:h1], out=dk[h0:h1])
        dq.mul_(ctx.scale)
        if need_t:
            gb = sum(parts_t.values()) if parts_t else bias.new_zeros(bias.shape)  # type: ignore[assignment]
        return (dq.view(b, h, nq, d), dk.view(b, h, nk, d), dvv.view(b, h, nk, dv), gb, None, None, None)


def native_biased_softmax(
    lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float,
    offsets: Tensor | None = None,
) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` on contiguous ``(B, H, N, ·)`` q, k, v and a 4-D bias
    broadcastable to ``(B, H, Nq, Nk)`` (same dtype; see :func:`library`).

    ``offsets``: the bias's per-offset values (:func:`._toeplitz.toeplitz_offsets`) where it
    is a ``(1, H|1, Nq, Nk)`` Toeplitz bias; then they are read instead of the bias and get
    its gradient."""
    nq, nk = q.shape[-2], k.shape[-2]
    if (offsets is not None and bias.shape[0] == 1 and bias.shape[1] in (1, q.shape[1])
            and offsets.shape == (bias.shape[1], nq + nk - 1) and offsets.device == q.device):
        values = offsets.to(q.dtype).contiguous()
        out_t: Tensor = _NativeBiasedSoftmax.apply(q, k, v, values, scale, lib, True)
        return out_t
    if bias.shape[-1] != nk:  # constant along keys: broadcast it (rare; it cancels in the softmax)
        bias = bias.expand(*bias.shape[:-1], nk)
    if bias.stride(-1) != 1 and nk > 1:
        bias = bias.contiguous()
    out: Tensor = _NativeBiasedSoftmax.apply(q, k, v, bias, scale, lib, False)
    return out
