r"""The fused Expsin attention with its elementwise passes in C (internal; ``_native/periodic.c``).

The same function as :class:`.periodic._FusedPeriodic` (implicit-kernel-attention
Table 2, eq. (9) and (11): periodic kernel ``exp(c(cos θ − 1))``, ``θ = ω‖q − k‖``, times the
L2 magnitude and an outside key bias ``e``, an optional additive mask), with every
``Nq × Nk`` and ``N × d`` elementwise pass of a chunk of heads in one C call that works row by
row while the row is in L1:

* forward: ``S = Q Kᵀ`` (``bmm``); in C, per row: ``‖q_i‖²``, (per head: ``‖k_j‖²`` and
  ``b_j = s‖k_j‖²/2 + e_j``), ``θ = √(ω²(‖q_i‖² + ‖k_j‖² − 2S_ij))``, ``cos θ`` and
  ``sin θ/θ`` from one range reduction, ``W = exp(c cos θ + b_j + m_ij − σ_i − c)`` with the
  detached shift ``σ_i = max_j (b_j + m_ij)`` (so every exponent is ``≤ 0``), ``r_i = 1/Σ_j W``
  and ``P = r W`` written over ``S``; then ``O = P V`` (``bmm``);
* backward: ``dP = dO Vᵀ`` (``bmm``); in C, per row: ``δ_i = <dO_i, O_i>``,
  ``dL = P ⊙ (dP − δ)``, ``E = dL ⊙ sin θ/θ`` written over ``dP``, its row sums and (per head)
  column sums, and the column sums of ``dL`` (the key bias's gradient); ``dV = Pᵀ dO``,
  ``E K`` and ``Eᵀ Q`` (``bmm``); one more C pass finishes
  ``dq_i = cω²((E k)_i − Σ_j E_ij q_i)``, ``dk_j = cω²((Eᵀ q)_j − Σ_i E_ij k_j) + s Σ_i dL_ij k_j``.

``P`` and ``sin θ/θ`` are saved up to ``THRESHOLDS.periodic_save_bytes`` and recomputed from
``S`` above (with the forward's shift and ``r``). Rows with no admissible key give zeros and
zero gradients; weights, ``dL`` and ``E`` below the smallest normal number are flushed to
zero in C (no subnormal reaches a matmul). float32's ``exp``, ``cos`` and ``sin`` are
vectorized polynomials (a few ulp; ``cos``/``sin`` after a Cody–Waite reduction), float64's
are libm's. Heads of a chunk are split over ``torch.get_num_threads()`` threads
(:func:`attnopt._native.parallel_rows`).

Measured: see :mod:`.periodic`. At N = 64 the six matmuls are about half the time, the C
passes a sixth (float32 about 1.2–1.7 ns per score in the forward and 1.6 ns in a recomputing
backward: a square root, a sine/cosine pair, an exponential and in the backward a division);
float64 fwd+bwd 1.6 → 1.1 ms (B·H = 8, N = 64) against the PyTorch node.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import fail, require, require_size, require_view
from attnopt.functional._autograd import refuse_double_backward

__all__ = ["library", "native_periodic_attention"]

_VP, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def library(*tensors: Tensor | None) -> ctypes.CDLL | None:
    """The compiled ``periodic.c`` when the native path applies to ``tensors`` (q first; None
    skipped): CPU float32/64 tensors with storage (not ``torch.func`` / fake tensors)."""
    q = tensors[0]
    assert q is not None
    if q.dtype not in (torch.float32, torch.float64) or q.device.type != "cpu":
        return None
    if not _native.has_storage(*tensors):
        return None
    return _native.library("periodic")


def _functions(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """The forward, backward and finishing C functions for ``dtype``, argument types declared
    once per library object (plain Python ints and floats are passed)."""
    suffix = "f64" if dtype == torch.float64 else "f32"
    done: dict[str, tuple[Any, Any, Any]] = lib.__dict__.setdefault("_attnopt_declared", {})
    hit = done.get(suffix)
    if hit is not None:
        return hit
    real = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
    fwd, bwd, fin = (getattr(lib, f"px_{n}_{suffix}") for n in ("fwd", "bwd", "fin"))
    fwd.restype = bwd.restype = fin.restype = None
    fwd.argtypes = [_VP] * 6 + [_I64] * 3 + [_VP] * 3 + [_I64] * 6 + [real] * 3
    bwd.argtypes = ([_VP] * 3 + [_INT] + [_VP] * 3 + [_I64] + [_VP] + [_I64] * 3 + [_VP] * 6
                    + [_I64] * 6 + [real] * 2)
    fin.argtypes = [_VP] * 7 + [_I64] * 5 + [real] * 2
    done[suffix] = (fwd, bwd, fin)
    return fwd, bwd, fin


def _run(call: Any, rows: int, row_len: int, threads: int) -> None:
    """``call(0, rows)`` on this thread, or split over threads by :func:`_native.parallel_rows`."""
    if threads <= 1:
        call(0, rows)
    else:
        _native.parallel_rows(call, rows, row_len)


def _address(t: Tensor | None, offset: int = 0) -> int | None:
    return None if t is None else t.data_ptr() + offset * t.element_size()


def _check_px(
    kernel: str, s: Tensor, sc: Tensor | None, dp: Tensor | None, q: Tensor, k: Tensor, e: Tensor | None,
    mask: Tensor | None, rep: int, aux: Tensor, state: Tensor, h0: int, h1: int, dout: Tensor | None = None,
    out: Tensor | None = None, rs: Tensor | None = None, colsums: Tensor | None = None,
) -> None:
    """What ``px_fwd`` (``dp`` None) / ``px_bwd`` read and write for the heads ``[h0, h1)`` of ``BH``:
    the chunk's dense scores ``s`` (and ``dp``), ``(h1 − h0, Nq, Nk)``; ``sc`` dense ``(BH, Nq, Nk)`` (read
    from head ``h0`` on); ``q (BH, Nq, d)``, ``k (BH, Nk, d)``, ``e (BH·Nk)``, ``aux (BH, 2, Nk)``, ``state
    (2, BH, Nq)`` dense; the mask's row ``i`` of head ``g`` at ``(g // rep)·msg + i·msi``, unit key stride;
    the backward's ``dout``, ``out (BH, Nq, Dv)``, ``rs (BH, Nq)``, ``colsums (2, BH, Nk)`` dense."""
    bh, nq, d = q.shape
    nk = k.shape[1]
    dtype = q.dtype
    require_size(kernel, "h1", h1, at_least=h0 + 1, at_most=bh)
    require_size(kernel, "h0", h0, at_least=0)
    require(kernel, "s", s, dtype=dtype, numel=(h1 - h0) * nq * nk)
    if dp is not None:
        require(kernel, "dp", dp, dtype=dtype, numel=(h1 - h0) * nq * nk)
    if sc is not None:
        require(kernel, "sc", sc, dtype=dtype, numel=bh * nq * nk)
    require(kernel, "q", q, dtype=dtype, numel=bh * nq * d)
    require(kernel, "k", k, dtype=dtype, numel=bh * nk * d)
    if e is not None:
        require(kernel, "e", e, dtype=dtype, numel=bh * nk)
    if mask is not None:
        if mask.dim() != 3 or mask.shape[2] != nk or (nk > 1 and mask.stride(2) != 1):
            raise fail(kernel, "mask", f"shape "
                       f"{tuple(mask.shape)}, strides {mask.stride()}: expected (G, Nq|1, {nk}), "
                                      "unit key stride")
        require_view(kernel, "mask", mask, dtype=dtype, sizes=((bh - 1) // max(rep, 1) + 1, nq, nk),
                     strides=(mask.stride(0), mask.stride(1), 1))
    require(kernel, "aux", aux, dtype=dtype, numel=bh * 2 * nk)
    require(kernel, "state", state, dtype=dtype, numel=2 * bh * nq)
    if dout is not None and out is not None:
        dv = out.shape[-1]
        require(kernel, "dout", dout, dtype=dtype, numel=bh * nq * dv)
        require(kernel, "out", out, dtype=dtype, numel=bh * nq * dv)
    if rs is not None:
        require(kernel, "rs", rs, dtype=dtype, numel=bh * nq)
    if colsums is not None:
        require(kernel, "colsums", colsums, dtype=dtype, numel=2 * bh * nk)


def _check_px_fin(gq: Tensor | None, q: Tensor, rs: Tensor, gk: Tensor | None, k: Tensor,
                  colsums: Tensor) -> None:
    """What ``px_fin`` reads and writes: ``q``, ``gq (BH, Nq, d)``, ``k``, ``gk (BH, Nk, d)`` dense, ``rs
    (BH, Nq)``, ``colsums (2, BH, Nk)``."""
    bh, nq, d = q.shape
    nk = k.shape[1]
    for name, t, n in (("dq", gq, bh * nq * d), ("q", q, bh * nq * d), ("rs", rs, bh * nq),
                       ("dk", gk, bh * nk * d), ("k", k, bh * nk * d), ("colsums", colsums, 2 * bh * nk)):
        if t is not None:
            require("px_fin", name, t, dtype=q.dtype, numel=n)


class _NativePeriodic(torch.autograd.Function):
    """q (…, Nq, d), k (…, Nk, d), v (…, Nk, dv) contiguous, the leading dims of each holding BH
    rows (flattened here, not by a tracked view: each view is one more autograd node, ~7 µs in
    the backward at N = 64); ``e`` (BH, 1, Nk) contiguous or None; mask (G, Nq, Nk) with unit
    key stride, constant, or None (row ``i`` of the batch reads ``mask[i // rep]``);
    ``om2 = ω²``, ``c``, ``s`` (0: no L2 magnitude); ``save``: keep ``P`` and ``sin θ/θ`` for the
    backward (else the backward recomputes them from ``S``); ``step``: heads per chunk; ``lead``:
    the output's batch dims. Gradients come back in the inputs' shapes."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None,
        rep: int, om2: float, c: float, s: float, save: bool, step: int, lib: ctypes.CDLL,
        lead: tuple[int, ...],
    ) -> Tensor:
        ctx.shapes = q.shape, k.shape, v.shape
        nq, d, nk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        q, k, v = q.view(-1, nq, d), k.view(-1, nk, d), v.view(-1, nk, dv)
        bh = q.shape[0]
        fwd = _functions(lib, q.dtype)[0]
        threads = torch.get_num_threads()
        p = q.new_empty(bh if save else min(step, bh), nq, nk)
        sc = q.new_empty(bh, nq, nk) if save else None
        aux, state = q.new_empty(bh, 2, nk), q.new_empty(2, bh, nq)  # (‖k‖², b); (shift, r)
        out = q.new_empty(bh, nq, dv)
        pq, pk, pe, paux = q.data_ptr(), k.data_ptr(), _address(e), aux.data_ptr()
        pshift, prinv = state.data_ptr(), _address(state, bh * nq)
        pm, msg, msi = (None, 0, 0) if mask is None else (mask.data_ptr(), mask.stride(0), mask.stride(1))
        kt = k.transpose(1, 2)
        for h0 in range(0, bh, step):
            h1 = min(bh, h0 + step)
            whole = h0 == 0 and h1 == bh
            buf = p if whole and p.shape[0] == bh else (p[h0:h1] if save else p[: h1 - h0])
            torch.bmm(q if whole else q[h0:h1], kt if whole else kt[h0:h1], out=buf)
            _check_px("px_fwd", buf, sc, None, q, k, e, mask, rep, aux, state, h0, h1)
            ps, psc = buf.data_ptr(), _address(sc, h0 * nq * nk)

            def rows(a: int, b: int, ps: int = ps, psc: int | None = psc, h0: int = h0) -> None:
                fwd(ps, psc, pq, pk, pe, pm, msg, msi, rep, paux, pshift, prinv, h0, h0 + a, h0 + b,
                    nq, nk, d, om2, c, 0.5 * s)

            _run(rows, h1 - h0, nq * nk, threads)
            torch.bmm(buf, v if whole else v[h0:h1], out=out if whole else out[h0:h1])
        ctx.om2, ctx.c, ctx.s, ctx.rep, ctx.step, ctx.lib = om2, c, s, rep, step, lib
        ctx.save_for_backward(q, k, v, mask, aux, state, out, p if save else None, sc)
        return out.view(*lead, nq, dv)

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "kernel_attention (fused Expsin)",
                               "use kernel_weights(q, k, kernel=...) @ v")
        q, k, v, mask, aux, state, out, p_all, sc_all = ctx.saved_tensors
        bh, nq, d = q.shape
        nk, dv = k.shape[1], v.shape[-1]
        _, bwd, fin = _functions(ctx.lib, q.dtype)
        threads, step = torch.get_num_threads(), ctx.step
        do = dout.to(q.dtype).contiguous().view(bh, nq, dv)
        need_q, need_k, need_v, need_e = ctx.needs_input_grad[:4]
        gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rs, colsums = q.new_empty(bh, nq), q.new_empty(2, bh, nk)  # Σ_j E; (Σ_i E, Σ_i dL)
        recompute = int(p_all is None)
        per = min(step, bh)
        s_buf = q.new_empty(per, nq, nk) if recompute else None  # sin θ/θ is used at once, not stored
        dp_buf = q.new_empty(per, nq, nk)
        pq, pdo, pout, paux = q.data_ptr(), do.data_ptr(), out.data_ptr(), aux.data_ptr()
        pshift, prinv = state.data_ptr(), _address(state, bh * nq)
        prs, pcs, pdls = rs.data_ptr(), colsums.data_ptr(), _address(colsums, bh * nk)
        pm, msg, msi = (None, 0, 0) if mask is None else (mask.data_ptr(), mask.stride(0), mask.stride(1))
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        om2, c = ctx.om2, ctx.c
        for h0 in range(0, bh, step):
            h1 = min(bh, h0 + step)
            f = slice(h0, h1)
            whole = h0 == 0 and h1 == bh
            qf, kf, dof = (q, k, do) if whole else (q[f], k[f], do[f])
            if recompute:
                assert s_buf is not None
                pw = torch.bmm(qf, kt if whole else kt[f], out=s_buf[: h1 - h0])
                psc = None
            else:
                pw = p_all if whole else p_all[f]
                psc = sc_all.data_ptr() + h0 * nq * nk * sc_all.element_size()
            dp = torch.bmm(dof, vt if whole else vt[f], out=dp_buf[: h1 - h0])
            _check_px("px_bwd", pw, None if recompute else sc_all, dp, q, k, None, mask, ctx.rep, aux,
                      state, h0, h1,
                      do, out, rs, colsums)
            ps, pdp = pw.data_ptr(), dp.data_ptr()

            def rows(a: int, b: int, ps: int = ps, psc: int | None = psc, pdp: int = pdp, h0: int = h0
                     ) -> None:
                bwd(ps, psc, pdp, recompute, pq, pdo, pout, dv, pm, msg, msi, ctx.rep, paux, pshift, prinv,
                    prs, pcs, pdls, h0, h0 + a, h0 + b, nq, nk, d, om2, c)

            _run(rows, h1 - h0, nq * nk, threads)
            torch.bmm(pw.transpose(1, 2), dof, out=gv if whole else gv[f])
            if need_q:
                torch.bmm(dp, kf, out=gq if whole else gq[f])
            if need_k:
                torch.bmm(dp.transpose(1, 2), qf, out=gk if whole else gk[f])
        if need_q or need_k:
            pgq, pgk = (gq.data_ptr() if need_q else None), (gk.data_ptr() if need_k else None)
            pk = k.data_ptr()
            _check_px_fin(gq if need_q else None, q, rs, gk if need_k else None, k, colsums)

            def finish(a: int, b: int) -> None:
                fin(pgq, pq, prs, pgk, pk, pcs, pdls, a, b, nq, nk, d, c * om2, ctx.s)

            _run(finish, bh, (nq + nk) * d, threads)
        ge = colsums[1].unsqueeze(1) if need_e else None
        sq, sk, sv = ctx.shapes
        return (gq.view(sq) if need_q else None, gk.view(sk) if need_k else None,
                gv.view(sv) if need_v else None, ge, None, None, None, None, None, None, None, None, None)


def native_periodic_attention(
    lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int,
    om2: float, c: float, s: float, save: bool, chunk_bytes: int, batch: tuple[int, ...],
) -> Tensor:
    """:class:`.periodic._FusedPeriodic`'s arguments, through the C passes of ``lib``
    (:func:`library`); heads are taken ``chunk_bytes`` of scores per thread at a time. Returns
    ``(*batch, Nq, dv)``."""
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    block = q.shape[-2] * k.shape[-2] * q.element_size()
    step = max(1, chunk_bytes * max(1, torch.get_num_threads()) // max(block, 1))
    out: Tensor = _NativePeriodic.apply(q, k, v, e, mask, rep, om2, c, s, save, step, lib, batch)
    return out
