r"""Softmax attention with an additive bias, elementwise passes in C (internal; ``_native/biased_softmax.c``).

The same math and chunking as :class:`.materialized._BiasedSoftmax`
(fenchel-dual-attention eq. (16)–(18), ``O = softmax(scale·QKᵀ + b) V``), with every
``Nq × Nk`` elementwise pass of a chunk in one C call that works row by row while the row is in
L1, and the bias read where it lies (a ``(1, H, Nq, Nk)`` bias is shared by the batch: no copy
per chunk). A relative-position bias (T5, ALiBi) that carries its values per offset ``j − i``
(:mod:`._toeplitz`, read by the router) is read from those, ``(H, Nq + Nk − 1)``: row ``i`` is
the window from ``Nq − 1 − i``, a few kB that stay in L1, and its gradient collects into
per-thread sums by offset (no ``(H, Nq, Nk)`` gradient, no diagonal-sum pass after).

* forward: ``S = (scale·Q) Kᵀ`` (``bmm``); in C, per row: ``x = S + b``, its maximum ``m``,
  ``E = exp(x − m)``, ``r = 1 / Σ E``; ``out = r ⊙ (E V)`` (the normalization on the small
  output instead of an ``Nq × Nk`` pass). Saved: ``m`` and ``r`` (O(N) per head), and ``E``
  itself up to ``THRESHOLDS.generalized_save_bytes`` (above, recomputed at any head dimension);
* backward: with ``dO' = r ⊙ dO``: ``dP' = dO' Vᵀ`` (``bmm``) and, where ``E`` was not saved,
  ``S`` again; in C, per row: ``E`` (bitwise as in the forward), ``dS = E ⊙ (dP' − r δ)``
  ``= P ⊙ (dP − δ)``, ``δ_i = <dO_i, O_i>``, and the bias gradient ``db += dS`` summed over the
  bias's broadcast batch / head dims in the same pass; then ``dV = Eᵀ dO'``,
  ``dQ = scale·dS K``, ``dK = dSᵀ(scale·Q)``.

Rows whose bias is ``-inf`` everywhere get zeros and zero gradients; NaN or ``+inf`` in the
bias raise (the C pass counts such rows). Weights and ``dS`` below the smallest normal
number are flushed to zero (as the PyTorch path does with the CPU's FTZ mode). float32's
exponential is a polynomial (about 2 ulp, see ``dnas.c``), float64's is libm's.

A chunk holds about ``THRESHOLDS.generalized_cpu_chunk_bytes`` of scores per thread (whole heads;
a head whose scores exceed twice that goes in equal blocks of query rows, ``dK`` and ``dV``
accumulated); its query rows are split over ``torch.get_num_threads()`` threads
(:func:`attnopt._native.parallel_rows`), so threads write disjoint rows of the bias gradient.

At small sizes a relative-position bias (T5's bucket table, ALiBi's offsets) takes the
*whole-call* path instead (:func:`fused_attention`, :class:`_FusedBiasedSoftmax`; ``bsf_*`` in
the C file): the forward of every head is one C call and the backward one, the six products per
head by PyTorch's own BLAS called from C (:func:`attnopt._native.blas`), ``E`` saved, the
finiteness of ``q``, ``k``, ``v`` checked in the same pass, and T5's per-offset gradient
scattered into its table in C. At B·H = 8, N = 64 (fwd+bwd 0.4 ms for SDPA) a Python node with
six ``bmm`` calls and a dozen elementwise ops costs ~0.3 ms in per-call overhead alone; the
whole-call path leaves ~0.1 ms.

Measured (1 thread, loaded 2-core machine): train step of ``TransformerEncoder`` (E = 64,
H = 4, B = 32, N = 512, 2 layers) with ``attention="t5"`` 1.44–1.52× → 1.07–1.10× the softmax
arm; the attention alone at B·H = 128, N = 512, d = 16 1.76× → 1.09× plain SDPA.

The whole-call kernels are also ``torch.library`` ops (issue 30 item 2), so that dynamo,
``torch.export``, the profiler and ``torch.func.grad`` see one op each way:

* ``attnopt::bsf_fwd(q, k, v, src, buckets, kind, scale) -> (out, E, 1/r)``
  (:func:`fused_forward`; fake implementation: the shapes alone);
* ``attnopt::bsf_bwd(dout, q, k, v, E, out, 1/r, src, buckets, kind, scale, need_bias) -> (dQ, dK,
  dV, d src)`` (:func:`fused_backward`), the forward op's registered autograd;
* the chunked passes likewise: ``attnopt::bs_fwd(q, k, v, bias, scale, toeplitz, need_grad) ->
  (out, E or empty, m, 1/r, scale·Q)`` (:func:`biased_forward`) and ``attnopt::bs_bwd``
  (:func:`biased_backward`).

Plain eager code (the router, :func:`fused_attention`, :func:`native_biased_softmax`) calls the
same functions through the autograd Functions :class:`_FusedBiasedSoftmax`,
:class:`_NativeBiasedSoftmax` instead: PyTorch's Python ``custom_op`` path
(dispatcher → Python kernel, and a second Python autograd node around it) costs a fixed few tens
of µs per call, which at B·H = 8, N = 64 is several per cent of the whole forward+backward (the
figures are in the commit that added the ops and in the issue-30 note). Both run the same C calls
with the same checks, so they agree bitwise (``tests/functional/test_generalized_ops.py``).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _func, _native
from attnopt._native.checks import fail, require, require_size, require_view
from attnopt._validation import check_finite, resolve_scale
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["biased_softmax_op", "fused_attention", "library", "native_biased_softmax",
           "traced_ops_apply"]

_I64, _INT = ctypes.c_int64, ctypes.c_int


def library(q: Tensor, *others: Tensor) -> ctypes.CDLL | None:
    """The compiled ``biased_softmax.c`` when the native path applies to ``q`` (and ``others``:
    k, v, the bias), else ``None``: CPU float32/64 tensors with storage (not ``torch.func`` /
    fake tensors)."""
    if (q.dtype not in (torch.float32, torch.float64) or q.device.type != "cpu"
            or not _native.has_storage(q, *others) or any(t.device != q.device for t in others)):
        return None
    return _native.library("biased_softmax")  # a built library is returned without a compiler lookup


def traced_ops_apply(q: Tensor, *others: Tensor) -> bool:
    """Whether a traced call (``torch.compile`` / ``torch.export``) takes the ``attnopt::bs_*`` ops
    (:func:`biased_softmax_op`): the library built (:func:`attnopt._native.ready`), CPU float32/64
    tensors of one dtype (not the meta or another device), no ``torch.func`` transform."""
    return (torch.compiler.is_compiling() and _native.ready("biased_softmax")
            and q.dtype in (torch.float32, torch.float64)
            and q.device.type == "cpu" and all(t.device == q.device and t.dtype == q.dtype for t in others)
            and not _func.under_transform())


def biased_softmax_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` as the one op ``attnopt::bs_fwd`` (its backward ``bs_bwd``): what a
    traced graph holds in place of :func:`native_biased_softmax` (same inputs: ``(B, H, N, ·)`` q, k, v,
    a 4-D bias broadcastable to ``(B, H, Nq, Nk)`` of their dtype)."""
    nk = k.shape[-2]
    if bias.shape[-1] != nk:
        bias = bias.expand(*bias.shape[:-1], nk)
    if bias.stride(-1) != 1 and nk > 1:
        bias = bias.contiguous()
    need = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, bias))
    out: Tensor = torch.ops.attnopt.bs_fwd(q, k, v, bias, scale, False, need)[0]
    return out


def _pieces(x: Tensor, step: int) -> Any:
    """``x.split(step)`` (``[x]`` when one piece: the Python split costs ~10 µs a call)."""
    return (x,) if x.shape[0] <= step else x.split(step)


def _chunks(g: int, block: int) -> list[tuple[int, int]]:
    """Flat head ranges ``[h0, h1)`` of about ``THRESHOLDS.generalized_cpu_chunk_bytes`` per thread."""
    step = max(1, THRESHOLDS.generalized_cpu_chunk_bytes * max(1, torch.get_num_threads()) // max(block, 1))
    return [(h, min(h + step, g)) for h in range(0, g, step)]


def _row_step(nq: int, nk: int, size: int) -> int:
    """Query rows per block when one head's ``Nq × Nk`` scores exceed twice the chunk, else 0
    (whole heads). Blocks of equal size: the train step's N = 513 (a class token) split into
    511 + 2 rows ran its attention 8 % slower than whole heads."""
    per_chunk = THRESHOLDS.generalized_cpu_chunk_bytes * max(1, torch.get_num_threads())
    if nq * nk * size <= 2 * per_chunk:
        return 0
    blocks = -(-nq * nk * size // per_chunk)
    return -(-nq // blocks)


def _strides(t: Tensor | None) -> tuple[int, int, int]:
    """Batch, head and row strides of a 4-D tensor in elements, 0 along size-1 dims."""
    if t is None:
        return 0, 0, 0
    return (0 if t.shape[0] == 1 else t.stride(0), 0 if t.shape[1] == 1 else t.stride(1),
            0 if t.shape[2] == 1 else t.stride(2))


def _layout(t: Tensor, toeplitz: bool, nq: int) -> tuple[int, tuple[int, int, int]]:
    """The C kernel's bias address and (batch, head, row) strides for ``t``.

    A Toeplitz bias's row ``i`` of head ``h`` starts at ``offsets[h, Nq − 1 − i]``: the address
    of ``offsets[0, Nq − 1]`` and row stride −1."""
    if not toeplitz:
        return t.data_ptr(), _strides(t)
    return t.data_ptr() + (nq - 1) * t.element_size(), (0, 0 if t.shape[0] == 1 else t.stride(0), -1)


_VP = ctypes.c_void_p


def _functions(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[Any, Any]:
    """The forward and backward C functions for ``dtype``, with their argument types declared
    (plain Python ints are passed: no ctypes objects per call). Declared once per library
    object and remembered on it (a test may load the library anew: a new object declares again)."""
    suffix = "f64" if dtype == torch.float64 else "f32"
    done: dict[str, tuple[Any, Any]] = lib.__dict__.setdefault("_attnopt_declared", {})
    hit = done.get(suffix)
    if hit is not None:  # declared before on this very library object (~5 µs a declaration)
        return hit
    fwd, bwd = getattr(lib, f"bs_fwd_{suffix}"), getattr(lib, f"bs_bwd_{suffix}")
    fwd.restype, bwd.restype = _I64, None
    fwd.argtypes = [_VP, _VP, _I64, _I64, _I64, _VP, _VP] + [_I64] * 9
    bwd.argtypes = [_VP, _VP, _INT, _VP, _I64, _I64, _I64, _VP, _VP, _VP, _VP] + [_I64] * 12
    done[suffix] = (fwd, bwd)
    return fwd, bwd


def _run(call: Any, rows: int, row_len: int, threads: int) -> None:
    """``call(0, rows)`` directly on one thread, else split by :func:`attnopt._native.parallel_rows`."""
    if threads <= 1:
        call(0, rows)
    else:
        _native.parallel_rows(call, rows, row_len)


@_native.untraced
def biased_forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, toeplitz: bool, need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, E or empty, m, 1/r, scale·Q)``: the chunked forward C passes (``bs_fwd``).

    q, k, v: (B, H, N, ·) of any strides; bias: 4-D (B|1, H|1, Nq|1, Nk) with unit key stride,
    or (``toeplitz``) contiguous per-offset values (H|1, Nq + Nk − 1) of a bias (1, H|1, Nq, Nk).
    ``E`` is returned (for the backward) when ``need_grad`` and it fits
    ``THRESHOLDS.generalized_save_bytes``, else recomputed there. The body of ``attnopt::bs_fwd``.

    Raises:
        ValueError: NaN or ``+inf`` in the bias, or overflowing scores.
    """
    lib = _native.library("biased_softmax")
    assert lib is not None
    b, h, nq, d = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g = b * h
    qs = torch.mul(q, scale, out=q.new_empty(b, h, nq, d))  # scaled and made contiguous at once
    k, v = k.contiguous(), v.contiguous()
    block = nq * nk * q.element_size()
    # E is recomputed above generalized_save_bytes at any head dimension (the PyTorch path saves P at
    # d >= 64):
    # learned T5 bias, d = 64, fwd+bwd vs SDPA: B·H = 64, N = 512 1.14x saved -> 1.01x recomputed;
    # B·H = 8, N = 1024 1.46x -> 1.36x
    # no backward: the chunk buffer only
    save = g * block <= THRESHOLDS.generalized_save_bytes and need_grad
    parts = _chunks(g, block)
    step = parts[0][1] - parts[0][0]
    p = q.new_empty(g if save else step, nq, nk)
    mx, rinv = q.new_empty(g, nq), q.new_empty(g, nq)
    out = q.new_empty(g, nq, dv)
    q3, k3, v3 = qs.view(g, nq, d), k.view(g, nk, d), v.view(g, nk, dv)
    fwd, _ = _functions(lib, q.dtype)
    base, (sb, sh, si) = _layout(bias, toeplitz, nq)
    pmx, prinv, threads = mx.data_ptr(), rinv.data_ptr(), torch.get_num_threads()
    bad: list[int] = []  # rows with NaN / +inf per call (list.append is atomic across threads)
    rstep = _row_step(nq, nk, q.element_size())
    with flush_denormal():
        if rstep:  # one head at a time, in blocks of query rows whose scores fit the cache
            for gi in range(g):
                for r0 in range(0, nq, rstep):
                    r1 = min(nq, r0 + rstep)
                    s = torch.mm(q3[gi, r0:r1], k3[gi].t(), out=p[gi, r0:r1] if save else p[0, : r1 - r0])
                    _check_bs("bs_fwd", s, None, (r1 - r0) * nk, bias, toeplitz, g, h, nq, nk, mx, rinv,
                              None,
                              (base, (sb, sh, si)))
                    ps = s.data_ptr()

                    def piece(a: int, e: int, ps: int = ps, gi: int = gi, r0: int = r0, r1: int = r1
                              ) -> None:
                        bad.append(fwd(ps, base, sb, sh, si, pmx, prinv, gi, gi + 1, h, r0, r1 - r0,
                                       r0 + a, r0 + e, nq, nk))

                    _run(piece, r1 - r0, nk, threads)
                    torch.mm(s, v3[gi], out=out[gi, r0:r1])
        for (h0, h1), qc, kc, vc, oc in zip(parts, _pieces(q3, step), _pieces(k3.transpose(1, 2), step),
                                            _pieces(v3, step), _pieces(out, step)):
            if rstep:
                break
            s = torch.bmm(qc, kc, out=p[h0:h1] if save else p[: h1 - h0])
            _check_bs("bs_fwd", s, None, (h1 - h0) * nq * nk, bias, toeplitz, g, h, nq, nk, mx, rinv,
                      None,
                              (base, (sb, sh, si)))
            ps = s.data_ptr()

            def rows(i0: int, i1: int, ps: int = ps, h0: int = h0, h1: int = h1) -> None:
                bad.append(fwd(ps, base, sb, sh, si, pmx, prinv, h0, h1, h, 0, nq, i0, i1, nq, nk))

            _run(rows, nq, (h1 - h0) * nk, threads)
            torch.bmm(s, vc, out=oc)
    out.mul_(rinv.unsqueeze(-1))
    if any(bad):  # q and k are finite (validated): NaN or +inf came from the bias
        if not bool(bias.amax(-1).max() < float("inf")):
            raise ValueError("log_preference must not contain NaN or +inf (-inf masks a key)")
        raise ValueError("the biased scores overflowed to +inf")
    return out.view(b, h, nq, dv), p if save else q.new_empty(0), mx, rinv, qs



@_native.untraced
def biased_backward(
    dout: Tensor, qs: Tensor, k: Tensor, v: Tensor, p: Tensor, out: Tensor, bias: Tensor, mx: Tensor,
    rinv: Tensor, scale: float, toeplitz: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d bias)`` of :func:`biased_forward` (``bs_bwd``; ``p`` empty: ``E`` recomputed;
    ``d bias`` empty unless ``need_bias``). The body of ``attnopt::bs_bwd``."""
    lib = _native.library("biased_softmax")
    assert lib is not None
    k, v = k.contiguous(), v.contiguous()
    b, h, nq, d = qs.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g = b * h
    out = out.reshape(g, nq, dv)
    # dO' = r dO, contiguous (dO of any strides, e.g. the transposed view of merged heads)
    do3 = torch.mul(dout.to(v.dtype), rinv.view(b, h, nq, 1), out=qs.new_empty(b, h, nq, dv))
    do3 = do3.view(g, nq, dv)
    delta = (do3 * out).sum(-1)  # r δ, (g, nq)
    q3, k3, v3 = qs.view(g, nq, d), k.view(g, nk, d), v.view(g, nk, dv)
    dq, dk, dvv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    toeplitz = toeplitz
    # the bias gradient: in place of the bias (threads write disjoint rows), or for a Toeplitz
    # bias one (H, Nq + Nk − 1) buffer of diagonal sums per thread (rows share offsets)
    gb = bias.new_zeros(bias.shape) if need_bias and not toeplitz else None
    parts_t: dict[int, Tensor] = {}
    need_t = need_bias and toeplitz
    block = nq * nk * qs.element_size()
    parts = _chunks(g, block)
    step = parts[0][1] - parts[0][0]
    recompute = int(p.numel() == 0)
    s_buf = qs.new_empty(step, nq, nk) if recompute else None
    dp_buf = qs.new_empty(step, nq, nk)
    _, bwd = _functions(lib, qs.dtype)
    base, (sb, sh, si) = _layout(bias, toeplitz, nq)
    gbase, (gsb, gsh, gsi) = (0, (0, 0, 0)) if gb is None else _layout(gb, False, nq)
    if gb is not None:
        _check_bias("bs_bwd", "gb", gb, False, g, h, nq, nk, bias.dtype)
    if need_t:
        gsb, gsh, gsi = sb, sh, si
    pmx, prinv, pdelta = mx.data_ptr(), rinv.data_ptr(), delta.data_ptr()
    # a bias broadcast over query rows: every row adds into the same gradient row (one thread)
    threads = 1 if gb is not None and gb.shape[2] == 1 else torch.get_num_threads()
    def grad_buffer(i0: int) -> int:
        """The bias-gradient address for the call whose rows start at ``i0``: for a Toeplitz
        bias that range's own buffer (the same range in every chunk; threads never share one)."""
        if not need_t:
            return gbase
        buf = parts_t.get(i0)
        if buf is None:
            buf = parts_t.setdefault(i0, bias.new_zeros(bias.shape))
            _check_bias("bs_bwd", "gb", buf, True, g, h, nq, nk, bias.dtype)
        return _layout(buf, True, nq)[0]

    rstep = _row_step(nq, nk, qs.element_size())
    with flush_denormal():
        if rstep:  # one head at a time, in blocks of query rows (dK and dV accumulate)
            for gi in range(g):
                for r0 in range(0, nq, rstep):
                    r1 = min(nq, r0 + rstep)
                    qr, dr = q3[gi, r0:r1], do3[gi, r0:r1]
                    if s_buf is not None:
                        s = torch.mm(qr, k3[gi].t(), out=s_buf[0, : r1 - r0])
                    else:
                        s = p[gi, r0:r1]
                    dp = torch.mm(dr, v3[gi].t(), out=dp_buf[0, : r1 - r0])
                    _check_bs("bs_bwd", s, dp, (r1 - r0) * nk, bias, toeplitz, g, h, nq, nk, mx, rinv,
                              delta,
                              (base, (sb, sh, si)))
                    ps, pdp = s.data_ptr(), dp.data_ptr()

                    def piece(a: int, e: int, ps: int = ps, pdp: int = pdp, gi: int = gi, r0: int = r0,
                              r1: int = r1) -> None:
                        bwd(ps, pdp, recompute, base, sb, sh, si, pmx, prinv, pdelta, grad_buffer(r0 + a),
                            gsb, gsh, gsi, gi, gi + 1, h, r0, r1 - r0, r0 + a, r0 + e, nq, nk)

                    _run(piece, r1 - r0, nk, threads)
                    if r0 == 0:
                        torch.mm(s.t(), dr, out=dvv[gi])
                        torch.mm(dp.t(), qr, out=dk[gi])
                    else:
                        dvv[gi].addmm_(s.t(), dr)
                        dk[gi].addmm_(dp.t(), qr)
                    dqr = dq[gi, r0:r1]  # dQ = scale·dS K: the scale applied inside the GEMM (alpha)
                    torch.addmm(dqr, dp, k3[gi], beta=0, alpha=scale, out=dqr)
        for (h0, h1), qc, kt, vt, dc, dqc, dkc, dvc in zip(
            parts, _pieces(q3, step), _pieces(k3.transpose(1, 2), step),
            _pieces(v3.transpose(1, 2), step), _pieces(do3, step), _pieces(dq, step), _pieces(dk, step),
            _pieces(dvv, step),
        ):
            if rstep:
                break
            if s_buf is not None:
                s = torch.bmm(qc, kt, out=s_buf[: h1 - h0])
            else:
                s = p[h0:h1]
            dp = torch.bmm(dc, vt, out=dp_buf[: h1 - h0])
            _check_bs("bs_bwd", s, dp, (h1 - h0) * nq * nk, bias, toeplitz, g, h, nq, nk, mx, rinv, delta,
                              (base, (sb, sh, si)))
            ps, pdp = s.data_ptr(), dp.data_ptr()

            def rows(i0: int, i1: int, ps: int = ps, pdp: int = pdp, h0: int = h0, h1: int = h1
                     ) -> None:
                bwd(ps, pdp, recompute, base, sb, sh, si, pmx, prinv, pdelta, grad_buffer(i0), gsb, gsh,
                    gsi, h0, h1, h, 0, nq, i0, i1, nq, nk)

            _run(rows, nq, (h1 - h0) * nk, threads)
            torch.bmm(s.transpose(1, 2), dc, out=dvc)
            # dQ = scale·dS K, the scale inside the GEMM (beta = 0: dqc is not read)
            torch.baddbmm(dqc, dp, kt.transpose(1, 2), beta=0, alpha=scale, out=dqc)
            torch.bmm(dp.transpose(1, 2), qc, out=dkc)
    if need_t:
        sums = list(parts_t.values())
        if len(sums) == 1:  # one thread: its buffer (Python's sum would add it to 0: a copy)
            gb = sums[0]
        else:
            gb = sum(sums[1:], sums[0]) if sums else bias.new_zeros(bias.shape)
    return (dq.view(b, h, nq, d), dk.view(b, h, nk, d), dvv.view(b, h, nk, dv),
            bias.new_empty(0) if gb is None else gb)




# --- what a forward saves and its backward computes: one definition for the eager autograd Functions
# (_NativeBiasedSoftmax, _FusedBiasedSoftmax) and the ops' registered autograd (bs_fwd, bsf_fwd) --------


def _bs_save(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Save what ``bs_bwd`` reads: ``inputs`` = (q, k, v, bias, scale, toeplitz, ...), ``output`` =
    (out, E or empty, m, 1/r, scale·Q) of :func:`biased_forward` (``output``: the name
    ``register_autograd`` passes it by)."""
    _, k, v, bias, scale, toeplitz = inputs[:6]
    out, p, mx, rinv, qs = output
    ctx.scale, ctx.toeplitz = scale, toeplitz
    ctx.save_for_backward(qs, k, v, p, out, bias, mx, rinv)


def _bs_grads(ctx: Any, dout: Tensor, backward: Any) -> tuple[Tensor | None, ...]:
    """``(dQ, dK, dV, d bias or None)`` by ``backward`` (:func:`biased_backward` or its op)."""
    need = ctx.needs_input_grad[3]
    dq, dk, dv, gb = backward(dout, *ctx.saved_tensors, ctx.scale, ctx.toeplitz, need)
    return dq, dk, dv, gb if need else None


def _bsf_save(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Save what ``bsf_bwd`` reads: ``inputs`` = (q, k, v, src, buckets, kind, scale), ``output`` =
    (out, E, 1/r) of :func:`fused_forward`."""
    q, k, v, src, buckets, kind, scale = inputs
    out, e, rinv = output
    ctx.kind, ctx.scale = kind, scale
    ctx.save_for_backward(q, k, v, e, out, rinv, src, buckets)


def _bsf_grads(ctx: Any, dout: Tensor, backward: Any) -> tuple[Tensor | None, ...]:
    """``(dQ, dK, dV, d src or None)`` by ``backward`` (:func:`fused_backward` or its op)."""
    need = ctx.needs_input_grad[3]
    dq, dk, dv, gsrc = backward(dout, *ctx.saved_tensors, ctx.kind, ctx.scale, need)
    return dq, dk, dv, gsrc if need else None


def _grads_like(
    q: Tensor, k: Tensor, v: Tensor, b: Tensor, need_bias: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward ops' fake outputs: gradients shaped as ``q, k, v, b`` (``b``'s empty unless
    ``need_bias``)."""
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            b.new_empty(b.shape if need_bias else (0,)))


class _NativeBiasedSoftmax(torch.autograd.Function):
    """:func:`biased_forward` / :func:`biased_backward` as one autograd node (plain eager calls)."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, toeplitz: bool,
    ) -> Tensor:
        outputs = biased_forward(q, k, v, bias, scale, toeplitz, any(ctx.needs_input_grad[:4]))
        _bs_save(ctx, (q, k, v, bias, scale, toeplitz), outputs)
        return outputs[0]

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        return (*_bs_grads(ctx, dout, biased_backward), None, None)


def native_biased_softmax(
    _lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float,
    offsets: Tensor | None = None,
) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` on contiguous ``(B, H, N, ·)`` q, k, v and a 4-D bias
    broadcastable to ``(B, H, Nq, Nk)`` (same dtype; see :func:`library`).

    ``offsets``: the bias's per-offset values (the router's :func:`._toeplitz.toeplitz_offsets`) where it
    is a ``(1, H|1, Nq, Nk)`` Toeplitz bias; then they are read instead of the bias and get
    its gradient."""
    nq, nk = q.shape[-2], k.shape[-2]
    if (offsets is not None and bias.shape[0] == 1 and bias.shape[1] in (1, q.shape[1])
            and offsets.shape == (bias.shape[1], nq + nk - 1) and offsets.device == q.device):
        values = offsets.to(q.dtype).contiguous()
        out_t: Tensor = _NativeBiasedSoftmax.apply(q, k, v, values, scale, True)
        return out_t
    if bias.shape[-1] != nk:  # constant along keys: broadcast it (rare; it cancels in the softmax)
        bias = bias.expand(*bias.shape[:-1], nk)
    if bias.stride(-1) != 1 and nk > 1:
        bias = bias.contiguous()
    out: Tensor = _NativeBiasedSoftmax.apply(q, k, v, bias, scale, False)
    return out


# --- whole-call path for small sizes: the forward in one C call, the backward in one -------------

#: How a fused call's bias is given: per-offset values ``(H|1, Nq + Nk − 1)`` of a Toeplitz bias,
#: or T5's bucket table ``(num_buckets, H)`` with the bucket of each offset.
OFFSETS, TABLE = 1, 2


def _fused_functions(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """``bsf_fwd``, ``bsf_bwd``, ``bsf_gather`` for ``dtype``, declared once per library."""
    suffix = "f64" if dtype == torch.float64 else "f32"
    done: dict[str, tuple[Any, Any, Any]] = lib.__dict__.setdefault("_attnopt_fused", {})
    hit = done.get(suffix)
    if hit is not None:
        return hit
    fwd, bwd = getattr(lib, f"bsf_fwd_{suffix}"), getattr(lib, f"bsf_bwd_{suffix}")
    gather = getattr(lib, f"bsf_gather_{suffix}")
    real = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
    fwd.restype, bwd.restype, gather.restype = _I64, None, None
    fwd.argtypes = ([_VP, _VP] + [_VP, _I64, _I64, _I64] * 4 + [_VP, _VP, _VP] + [_I64] * 7
                    + [real, _INT])
    bwd.argtypes = ([_VP, _VP] + [_VP, _I64, _I64, _I64] * 3 + [_VP, _I64, _I64, _I64, _I64]
                    + [_VP, _VP, _VP] + [_VP, _I64, _I64, _I64] + [_VP, _VP, _I64, _I64] + [_VP] * 4
                    + [_I64] * 7 + [real])
    gather.argtypes = [_VP, _I64, _I64, _VP, _I64, _I64, _VP]
    done[suffix] = (fwd, bwd, gather)
    return done[suffix]


def _blas_for(dtype: torch.dtype) -> tuple[int, int]:
    """``(gemm address, MKL thread setter address)`` of PyTorch's own BLAS for ``dtype``."""
    found = _native.blas()
    assert found is not None  # fused_attention checked it
    return (found.dgemm if dtype == torch.float64 else found.sgemm), found.set_threads


def _head_strides(t: Tensor) -> tuple[int, int, int, int]:
    """Address and (batch, head, row) element strides of a 4-D tensor laid out as :func:`_unit`
    leaves it (one row: the row stride BLAS is given is the row length, whatever the tensor says)."""
    s = t.stride()
    return t.data_ptr(), s[0], s[1], s[2] if t.shape[2] > 1 else t.shape[3]


def _unit(t: Tensor) -> Tensor:
    """``t`` with a unit column stride and rows that do not overlap (BLAS's ``ld >= columns``),
    copied only where it has not."""
    s, n = t.stride(), t.shape
    if (s[3] == 1 or n[3] == 1) and (n[2] == 1 or s[2] >= n[3]):
        return t
    return t.contiguous()


def _bias_grad_layout(buf: Tensor, nq: int) -> tuple[int, int, int, int]:
    """The C kernel's address and strides of a per-offset gradient buffer ``(H|1, Nq + Nk − 1)``."""
    return buf.data_ptr() + (nq - 1) * buf.element_size(), 0, 0 if buf.shape[0] == 1 else buf.stride(0), -1


@_native.untraced
def fused_forward(
    q: Tensor, k: Tensor, v: Tensor, src: Tensor, buckets: Tensor | None, kind: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, E, 1/r)``: the forward C call(s) of ``softmax(scale·QKᵀ + bias) V`` (``bsf_fwd``).

    q, k, v: ``(B, H, N, ·)`` of one batch shape with unit column stride (:func:`_unit`); ``src`` by
    ``kind``: per-offset values ``(H|1, Nq + Nk − 1)`` (contiguous) of a Toeplitz bias
    (:data:`OFFSETS`), or a bucket table ``(num_buckets, H)`` with ``buckets (Nq + Nk − 1,)``
    (:data:`TABLE`). ``E (B·H, Nq, Nk)`` holds the unnormalized weights, ``1/r (B·H, Nq)`` the row
    normalizers. The body of the ``attnopt::bsf_fwd`` op.

    Raises:
        ValueError: non-finite ``q``, ``k``, ``v``, NaN / ``+inf`` in the bias, or overflowing scores.
    """
    lib = _native.library("biased_softmax")
    assert lib is not None
    fwd, _, gather = _fused_functions(lib, q.dtype)
    gemm, set_threads = _blas_for(q.dtype)
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    g = b * h
    if kind == TABLE:
        assert buckets is not None
        bias = q.new_empty(h, nq + nk - 1)
        _check_bsf_gather(src, buckets, bias, h, nq + nk - 1)
        gather(src.data_ptr(), src.stride(0), src.stride(1), buckets.data_ptr(), h, nq + nk - 1,
               bias.data_ptr())
    else:
        bias = src
    base, (sb, sh, si) = _layout(bias, True, nq)
    e, rinv = q.new_empty(g, nq, nk), q.new_empty(g, nq)
    out = q.new_empty(b, h, nq, dv)
    qa, ka, va = _head_strides(q), _head_strides(k), _head_strides(v)
    _check_bsf("bsf_fwd", q, k, v, (qa, ka, va), bias, e, out, rinv, None, None, (base, (sb, sh, si)))
    po, pe, pr = out.data_ptr(), e.data_ptr(), rinv.data_ptr()
    threads = torch.get_num_threads()
    if threads <= 1 or g * nq * nk < _native.min_parallel():
        flags = fwd(gemm, set_threads, *qa, *ka, *va, base, sb, sh, si, pe, po, pr, 0, g, h, nq, nk, d,
                    dv, scale, 1)
    else:
        res: list[int] = []  # list.append is atomic across threads

        def heads(g0: int, g1: int) -> None:
            res.append(fwd(gemm, set_threads, *qa, *ka, *va, base, sb, sh, si, pe, po, pr, g0, g1, h, nq,
                           nk, d, dv, scale, 1))

        _native.parallel_rows(heads, g, nq * nk)
        flags = 0
        for r in res:
            flags |= r
    if flags:
        if flags >> 32:  # a non-finite q, k or v: the entry check names it
            check_finite(q=q, k=k, v=v)
        if not bool(bias.amax(-1).max() < float("inf")):
            raise ValueError("log_preference must not contain NaN or +inf (-inf masks a key)")
        raise ValueError("the biased scores overflowed to +inf")
    return out, e, rinv


@_native.untraced
def fused_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, e: Tensor, out: Tensor, rinv: Tensor, src: Tensor,
    buckets: Tensor | None, kind: int, scale: float, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d src)`` of :func:`fused_forward` (``bsf_bwd``, one C call per thread); ``d src``
    (``src``'s shape: the per-offset values or T5's bucket table) is empty unless ``need_bias``.
    The body of the ``attnopt::bsf_bwd`` op."""
    lib = _native.library("biased_softmax")
    assert lib is not None
    _, bwd, _ = _fused_functions(lib, q.dtype)
    gemm, set_threads = _blas_for(q.dtype)
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    g = b * h
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    dq, dk, dvv = q.new_empty(b, h, nq, d), k.new_empty(b, h, nk, d), v.new_empty(b, h, nk, dv)
    threads = min(torch.get_num_threads(), g) if g * nq * nk >= _native.min_parallel() else 1
    # the bias gradient, one buffer per thread: T5's table itself (the C pass adds each head's
    # sums by offset into the buckets), else the per-offset values' shape
    table = src if kind == TABLE else None
    gbufs = [q.new_zeros(src.shape) for _ in range(threads)] if need_bias else []
    pb = buckets.data_ptr() if table is not None and buckets is not None else 0
    per = 2 * nq * nk + nq * (dv + 1) + nq + nk - 1
    work = q.new_empty(threads, per)
    qa, ka, va = _head_strides(q), _head_strides(k), _head_strides(v)
    ds = dout.stride()
    pe, po, pr = e.data_ptr(), out.data_ptr(), rinv.data_ptr()
    pq, pk, pv = dq.data_ptr(), dk.data_ptr(), dvv.data_ptr()
    bounds = [g * i // threads for i in range(threads + 1)]
    _check_bsf("bsf_bwd", q, k, v, (qa, ka, va), None, e, out, rinv, dout, work)
    for buf in gbufs:
        if table is None:
            _check_bias("bsf_bwd", "gb", buf, True, g, h, nq, nk, q.dtype)
        else:
            assert buckets is not None
            _check_bsf_gather(buf, buckets, None, h, nq + nk - 1)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dvv)):
        require("bsf_bwd", name, t, dtype=q.dtype)

    def heads(t: int) -> None:
        if not need_bias:
            ga: tuple[int, ...] = (0, 0, 0, 0, 0, 0, 0, 0)
        elif table is None:
            ga = (*_bias_grad_layout(gbufs[t], nq), 0, 0, 0, 0)
        else:
            gt = gbufs[t]
            ga = (0, 0, 0, 0, pb, gt.data_ptr(), gt.stride(0), gt.stride(1))
        bwd(gemm, set_threads, *qa, *ka, *va, dout.data_ptr(), *ds, pe, po, pr, *ga, pq, pk, pv,
            work[t].data_ptr(), bounds[t], bounds[t + 1], h, nq, nk, d, dv, scale)

    if threads == 1:
        heads(0)
    else:
        pool = _native._pool(threads)
        futures = [pool.submit(heads, t) for t in range(1, threads)]
        heads(0)
        for f in futures:
            f.result()
    if not need_bias:
        return dq, dk, dvv, src.new_empty(0)
    gb = gbufs[0]
    for extra in gbufs[1:]:
        gb += extra
    return dq, dk, dvv, gb


class _FusedBiasedSoftmax(torch.autograd.Function):
    """:func:`fused_forward` / :func:`fused_backward` as one autograd node (plain eager calls)."""

    @staticmethod
    @_native.untraced
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, src: Tensor, buckets: Tensor | None, kind: int,
                scale: float) -> Tensor:
        outputs = fused_forward(q, k, v, src, buckets, kind, scale)
        _bsf_save(ctx, (q, k, v, src, buckets, kind, scale), outputs)
        return outputs[0]

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        return (*_bsf_grads(ctx, dout, fused_backward), None, None, None)


def fused_attention(
    q: Tensor, k: Tensor, v: Tensor, log_u: Tensor, table: tuple[Tensor, Tensor] | None,
    offsets: Tensor | None, scale: float | None, is_causal: bool, limit: int, head_limit: int,
) -> Tensor | None:
    """``softmax(scale·QKᵀ + log_u (+ causal)) V`` by :class:`_FusedBiasedSoftmax` where it applies,
    else ``None`` (then nothing was checked or run).

    It applies to a relative-position ``log_u`` marked by :mod:`._toeplitz` (T5's ``table`` =
    ``(weights, buckets)``, else ALiBi's per-offset ``offsets``: the router reads the marks),
    ``q, k, v`` CPU float32/64 tensors with storage of one shape ``(B, H, N, ·)`` and dtype,
    ``0 < B·H·Nq·Nk <= limit`` and ``Nq·Nk <= head_limit``, under autograd with an input that
    needs a gradient, where the native kernels and :func:`attnopt._native.blas` are there. The entry checks of
    :func:`attnopt.functional.generalized.generalized_attention` that remain are made here or in the C forward
    (non-finite ``q``, ``k``, ``v`` or bias rows raise the same ``ValueError``)."""
    if not _native.has_storage(q, k, v, log_u) or log_u.dim() != 4:
        return None
    if (table is None and offsets is None) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    size = b * h * nq * nk
    dtype = q.dtype
    if (not 0 < size <= limit or nq * nk > head_limit or d == 0 or dv == 0 or k.shape != (b, h, nk, d)
            or v.shape[:3] != (b, h, nk)
            or dtype not in (torch.float32, torch.float64) or k.dtype != dtype or v.dtype != dtype
            or not (q.is_cpu and k.is_cpu and v.is_cpu and log_u.is_cpu)
            or log_u.shape[0] != 1 or log_u.shape[1] not in (1, h)
            or log_u.shape[2:] != (nq, nk)):
        return None
    if not (torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad or log_u.requires_grad)):
        return None
    # under a dispatch mode (FlopCounterMode, the claims' PeakMemory) the node's aten ops are seen;
    # the products inside the C call would not be (as in the Fourier whole-call path)
    if torch._C._len_torch_dispatch_stack():
        return None
    found = _native.blas()
    lib = _native.library("biased_softmax") if found is not None else None
    if lib is None or found is None:
        return None
    alpha = resolve_scale(scale, d)
    kind, buckets = TABLE, None
    if table is not None:
        src, buckets = table
        if is_causal:
            kind, src = OFFSETS, src.t().index_select(1, buckets)
    else:
        assert offsets is not None
        kind, src = OFFSETS, offsets
    if not log_u.requires_grad:
        src = src.detach()  # a bias built without a graph gives its table no gradient
    if src.dtype != dtype:
        src = src.to(dtype)
    if is_causal:  # SDPA's top-left mask: key j hidden from query i where j − i > 0
        hidden = torch.arange(nq + nk - 1, device=q.device) > nq - 1
        src = src.masked_fill(hidden, float("-inf"))
    elif kind == OFFSETS and not src.is_contiguous():
        src = src.contiguous()
    _fused_functions(lib, dtype)  # declared outside the op bodies (once per library)
    out: Tensor = _FusedBiasedSoftmax.apply(_unit(q), _unit(k), _unit(v), src, buckets, kind, alpha)
    return out


# --- what the C kernels receive (issue 29): one check per entry family, before each call -------------


def _check_bias(kernel: str, name: str, t: Tensor, toeplitz: bool, g: int, h: int, nq: int, nk: int,
                dtype: torch.dtype, layout: tuple[int, tuple[int, int, int]] | None = None) -> None:
    """A bias (or its gradient buffer) as the kernels read it for ``g = B·H`` heads at ``layout``, the
    address and (batch, head, row) strides handed to C (default :func:`_layout`'s): ``(b, h, i, j)`` at
    ``b·sb + h·sh + i·si + j`` from the address (``j`` unit stride: a 4-D bias with ``Nk`` keys), or for a
    Toeplitz bias ``(H|1, Nq + Nk − 1)`` (contiguous) from ``offsets[0, Nq − 1]`` with ``si = −1``."""
    if toeplitz:
        if t.dim() != 2 or t.shape[-1] != nq + nk - 1 or t.shape[0] not in (1, h) or not t.is_contiguous():
            raise fail(kernel, name, f"a "
                       f"Toeplitz bias of shape {tuple(t.shape)}, expected contiguous "
                       f"({h}|1, {nq + nk - 1})")
    elif t.dim() != 4 or t.shape[-1] != nk or (nk > 1 and t.stride(-1) != 1):
        raise fail(kernel, name, f"shape "
                   f"{tuple(t.shape)}, strides {t.stride()}: expected 4-D, {nk} keys of unit stride")
    base, strides = _layout(t, toeplitz, nq) if layout is None else layout
    offset, rest = divmod(base - t.data_ptr(), t.element_size())
    if rest:
        raise fail(kernel, name, "an address "
                                  "between two elements")
    require_view(kernel, name, t, dtype=dtype, sizes=((g - 1) // max(h, 1) + 1, h, nq, nk),
                 strides=(*strides, 1),
                 offset=offset)


def _check_bs(kernel: str, s: Tensor, dp: Tensor | None, entries: int, bias: Tensor, toeplitz: bool, g: int,
              h: int, nq: int, nk: int, mx: Tensor, rinv: Tensor, delta: Tensor | None,
              layout: tuple[int, tuple[int, int, int]]) -> None:
    """What ``bs_fwd`` (``dp`` None) / ``bs_bwd`` read and write: the block's dense scores ``s`` (and
    ``dp``) of ``entries`` values, the bias at ``layout`` (:func:`_check_bias`), ``G·Nq`` row values
    ``mx``, ``rinv``, ``delta``."""
    dtype = s.dtype
    require(kernel, "s", s, dtype=dtype, numel=entries)
    if dp is not None:
        require(kernel, "dp", dp, dtype=dtype, numel=entries)
    _check_bias(kernel, "bias", bias, toeplitz, g, h, nq, nk, dtype, layout)
    require(kernel, "mx", mx, dtype=dtype, numel=g * nq)
    require(kernel, "rinv", rinv, dtype=dtype, numel=g * nq)
    if delta is not None:
        require(kernel, "delta", delta, dtype=dtype, numel=g * nq)


def _check_bsf_gather(table: Tensor, buckets: Tensor, out: Tensor | None, h: int, c: int) -> None:
    """``bsf_gather`` (and the bucket-table gradient of ``bsf_bwd``, ``out`` None): a 2-D
    ``(rows, H)`` table read with its strides, ``C = Nq + Nk − 1`` int64 buckets (values below
    ``rows``: T5's buckets are clamped to ``num_buckets − 1``), ``out`` dense ``(H, C)``."""
    if table.dim() != 2 or table.shape[1] != h:
        raise fail("bsf_gather", "table", f"shape "
                   f"{tuple(table.shape)}, expected (num_buckets, {h})")
    require_view("bsf_gather", "table", table, dtype=table.dtype, sizes=tuple(table.shape),
                 strides=table.stride())
    require("bsf_gather", "buckets", buckets, dtype=torch.int64, numel=c)
    if out is not None:
        require("bsf_gather", "out", out, dtype=table.dtype, numel=h * c)


def _heads_view(kernel: str, name: str, t: Tensor, dtype: torch.dtype, rows: int, cols: int,
                passed: tuple[int, int, int, int]) -> None:
    """A ``(B, H, rows, cols)`` tensor read from the address and (batch, head, row) strides ``passed``
    (:func:`_head_strides`), unit columns: its own, and inside its storage."""
    s, n = t.stride(), t.shape
    if len(n) != 4 or n[2] != rows or n[3] != cols or (cols > 1 and s[3] != 1) or passed[0] != t.data_ptr():
        raise fail(kernel, name, f"shape "
                   f"{tuple(n)}, strides {s}: expected (B, H, {rows}, {cols}), unit columns")
    require_view(kernel, name, t, dtype=dtype, sizes=n, strides=(passed[1], passed[2], passed[3], 1))


def _check_bsf(kernel: str, q: Tensor, k: Tensor, v: Tensor, heads: tuple[tuple[int, int, int, int], ...],
               bias: Tensor | None, e: Tensor, out: Tensor, rinv: Tensor, dout: Tensor | None,
               work: Tensor | None, layout: tuple[int, tuple[int, int, int]] | None = None) -> None:
    """What ``bsf_fwd`` / ``bsf_bwd`` read and write: ``q, k, v`` of one ``(B, H)`` with unit columns,
    the Toeplitz bias (forward), ``G·Nq·Nk`` weights ``e``, ``out (B, H, Nq, Dv)``, ``G·Nq`` ``rinv``;
    the backward reads ``dout`` with its four strides and uses per thread a row of ``work`` of
    ``2·Nq·Nk + Nq·(Dv + 1) + Nq + Nk − 1`` entries."""
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    dtype, g = q.dtype, b * h
    _heads_view(kernel, "q", q, dtype, nq, d, heads[0])
    _heads_view(kernel, "k", k, dtype, nk, d, heads[1])
    _heads_view(kernel, "v", v, dtype, nk, dv, heads[2])
    if k.shape[:2] != (b, h) or v.shape[:3] != (b, h, nk):
        raise fail(kernel, None, f"q, k, v shapes "
                   f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if bias is not None:
        _check_bias(kernel, "bias", bias, True, g, h, nq, nk, dtype, layout)
    require(kernel, "e", e, dtype=dtype, numel=g * nq * nk)
    require(kernel, "out", out, dtype=dtype, numel=g * nq * dv)
    require(kernel, "rinv", rinv, dtype=dtype, numel=g * nq)
    if dout is not None:
        if tuple(dout.shape) != (b, h, nq, dv):
            raise fail(kernel, "dout", f"shape "
                       f"{tuple(dout.shape)}, expected {(b, h, nq, dv)}")
        require_view(kernel, "dout", dout, dtype=dtype, sizes=tuple(dout.shape), strides=dout.stride())
    if work is not None:
        require(kernel, "work", work, dtype=dtype)
        require_size(kernel, "work", work.shape[1], at_least=2 * nq * nk + nq * (dv + 1) + nq + nk - 1)


# --- the whole-call kernels as torch.library ops (issue 30 item 2) ----------------------------------


@torch.library.custom_op("attnopt::bsf_fwd", mutates_args=(), device_types="cpu")
def bsf_fwd(
    q: Tensor, k: Tensor, v: Tensor, src: Tensor, buckets: Tensor | None, kind: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, E, 1/r)`` of ``softmax(scale·QKᵀ + bias) V`` with a relative-position bias
    (:func:`fused_forward`)."""
    return fused_forward(q, k, v, src, buckets, kind, scale)


@bsf_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, src: Tensor, buckets: Tensor | None, kind: int,  # noqa: ARG001
      scale: float) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ARG001
    b, h, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[3]
    return q.new_empty(b, h, nq, dv), q.new_empty(b * h, nq, nk), q.new_empty(b * h, nq)


@torch.library.custom_op("attnopt::bsf_bwd", mutates_args=(), device_types="cpu")
def bsf_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, e: Tensor, out: Tensor, rinv: Tensor, src: Tensor,
    buckets: Tensor | None, kind: int, scale: float, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d src)`` of :func:`bsf_fwd` (:func:`fused_backward`; ``d src`` empty unless
    ``need_bias``)."""
    return fused_backward(dout, q, k, v, e, out, rinv, src, buckets, kind, scale, need_bias)


@bsf_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, e: Tensor, out: Tensor, rinv: Tensor,  # noqa: ARG001
      src: Tensor, buckets: Tensor | None, kind: int, scale: float,  # noqa: ARG001
      need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _grads_like(q, k, v, src, need_bias)


def _bsf_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    return (*_bsf_grads(ctx, dout, torch.ops.attnopt.bsf_bwd), None, None, None)


bsf_fwd.register_autograd(_bsf_backward, setup_context=_bsf_save)


@torch.library.custom_op("attnopt::bs_fwd", mutates_args=(), device_types="cpu")
def bs_fwd(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, toeplitz: bool, need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, E or empty, m, 1/r, scale·Q)`` of ``softmax(scale·QKᵀ + bias) V`` by the chunked C
    passes (:func:`biased_forward`)."""
    return biased_forward(q, k, v, bias, scale, toeplitz, need_grad)


@bs_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, toeplitz: bool,  # noqa: ARG001
      need_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, nq, d = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g = b * h
    save = need_grad and g * nq * nk * q.element_size() <= THRESHOLDS.generalized_save_bytes
    return (q.new_empty(b, h, nq, dv), q.new_empty(g, nq, nk) if save else q.new_empty(0), q.new_empty(g, nq),
            q.new_empty(g, nq), q.new_empty(b, h, nq, d))


@torch.library.custom_op("attnopt::bs_bwd", mutates_args=(), device_types="cpu")
def bs_bwd(
    dout: Tensor, qs: Tensor, k: Tensor, v: Tensor, p: Tensor, out: Tensor, bias: Tensor, mx: Tensor,
    rinv: Tensor, scale: float, toeplitz: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d bias)`` of :func:`bs_fwd` (:func:`biased_backward`)."""
    return biased_backward(dout, qs, k, v, p, out, bias, mx, rinv, scale, toeplitz, need_bias)


@bs_bwd.register_fake
def _(dout: Tensor, qs: Tensor, k: Tensor, v: Tensor, p: Tensor, out: Tensor, bias: Tensor,  # noqa: ARG001
      mx: Tensor, rinv: Tensor, scale: float, toeplitz: bool,  # noqa: ARG001
      need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _grads_like(qs, k, v, bias, need_bias)


def _bs_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    return (*_bs_grads(ctx, dout, torch.ops.attnopt.bs_bwd), None, None, None)


bs_fwd.register_autograd(_bs_backward, setup_context=_bs_save)
