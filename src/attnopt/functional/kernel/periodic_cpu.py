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

The passes are also ``torch.library`` ops (issue 30 item 2): ``attnopt::px_fwd(q, k, v, e, mask,
rep, ω², c, s, save, step) -> (out (BH, Nq, dv), aux, state, P or empty, sin θ/θ or empty)``
(:func:`periodic_forward`) and ``attnopt::px_bwd`` (:func:`periodic_backward`), connected by
``register_autograd``. Plain eager code (:func:`native_periodic_attention`) calls the same
functions through the autograd Function :class:`_NativePeriodic`: the Python ``custom_op`` path
costs a fixed few tens of µs more per call (figures in the issue-30 note).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import fail, require, require_size, require_view
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._thresholds import THRESHOLDS

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


def ready() -> bool:
    """Whether ``periodic.c`` is built, readable while ``torch.compile`` / ``torch.export`` trace
    (:func:`attnopt._native.ready`: answered at trace time, a constant of the graph)."""
    return _native.ready("periodic")


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
    rows = (h1 - h0) * nq * nk
    dense: tuple[tuple[str, Tensor | None, int], ...] = (
        ("s", s, rows), ("dp", dp, rows), ("sc", sc, bh * nq * nk), ("q", q, bh * nq * d),
        ("k", k, bh * nk * d), ("e", e, bh * nk), ("aux", aux, bh * 2 * nk),
        ("state", state, 2 * bh * nq), ("rs", rs, bh * nq), ("colsums", colsums, 2 * bh * nk))
    if dout is not None and out is not None:
        dv = out.shape[-1]
        dense += (("dout", dout, bh * nq * dv), ("out", out, bh * nq * dv))
    _require_dense(kernel, dtype, dense)
    if mask is not None:
        if mask.dim() != 3 or mask.shape[2] != nk or (nk > 1 and mask.stride(2) != 1):
            raise fail(kernel, "mask", f"shape "
                       f"{tuple(mask.shape)}, strides {mask.stride()}: expected (G, Nq|1, {nk}), "
                                      "unit key stride")
        require_view(kernel, "mask", mask, dtype=dtype, sizes=((bh - 1) // max(rep, 1) + 1, nq, nk),
                     strides=(mask.stride(0), mask.stride(1), 1))


def _require_dense(kernel: str, dtype: torch.dtype,
                   dense: tuple[tuple[str, Tensor | None, int], ...]) -> None:
    """:func:`require` (``numel`` exact, contiguous) on each ``(name, tensor or None, numel)``: the tests
    inline, :func:`require` only to name a failure (~10 tensors a pass at N = 64, where a call's Python
    is a large share of its time)."""
    for name, t, n in dense:
        if t is not None and not (t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.numel() == n):
            require(kernel, name, t, dtype=dtype, numel=n)


def _check_px_fin(gq: Tensor | None, q: Tensor, rs: Tensor, gk: Tensor | None, k: Tensor,
                  colsums: Tensor) -> None:
    """What ``px_fin`` reads and writes: ``q``, ``gq (BH, Nq, d)``, ``k``, ``gk (BH, Nk, d)`` dense, ``rs
    (BH, Nq)``, ``colsums (2, BH, Nk)``."""
    bh, nq, d = q.shape
    nk = k.shape[1]
    _require_dense("px_fin", q.dtype, (("dq", gq, bh * nq * d), ("q", q, bh * nq * d), ("rs", rs, bh * nq),
                                       ("dk", gk, bh * nk * d), ("k", k, bh * nk * d),
                                       ("colsums", colsums, 2 * bh * nk)))


@_native.untraced
def periodic_forward(
    q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int, om2: float, c: float,
    s: float, save: bool, step: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out (BH, Nq, dv), aux, state, P or empty, sin θ/θ or empty)``: the forward C passes
    (``px_fwd``). The body of ``attnopt::px_fwd``.

    q (…, Nq, d), k (…, Nk, d), v (…, Nk, dv) contiguous, the leading dims of each holding BH
    rows (flattened here, not by a tracked view: each view is one more autograd node, ~7 µs in
    the backward at N = 64); ``e`` (BH, 1, Nk) contiguous or None; mask (G, Nq, Nk) with unit
    key stride, constant, or None (row ``i`` of the batch reads ``mask[i // rep]``);
    ``om2 = ω²``, ``c``, ``s`` (0: no L2 magnitude); ``save``: keep ``P`` and ``sin θ/θ`` for the
    backward (else the backward recomputes them from ``S``); ``step``: heads per chunk (<= 0:
    ``THRESHOLDS.periodic_chunk_bytes`` of scores per thread, as :func:`native_periodic_attention`;
    the traced op's choice); ``lead``: the output's batch dims. Gradients come back in the inputs' shapes.
    """
    lib = _native.library("periodic")
    assert lib is not None
    nq, d, nk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    q, k, v = q.view(-1, nq, d), k.view(-1, nk, d), v.view(-1, nk, dv)
    bh = q.shape[0]
    step = step if step > 0 else _step(q, k, THRESHOLDS.periodic_chunk_bytes)
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
    return out, aux, state, p if save else q.new_empty(0), q.new_empty(0) if sc is None else sc



@_native.untraced
def periodic_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, aux: Tensor, state: Tensor,
    out: Tensor, p_all: Tensor, sc_all: Tensor, rep: int, om2: float, c: float, s: float, step: int,
    need_q: bool, need_k: bool, need_e: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d e)`` of :func:`periodic_forward` in the inputs' shapes (``px_bwd``, ``px_fin``;
    ``p_all`` empty: ``P`` recomputed; ``d e`` empty unless ``need_e``). The body of ``attnopt::px_bwd``."""
    lib = _native.library("periodic")
    assert lib is not None
    sq, sk, sv = q.shape, k.shape, v.shape
    nq, d, nk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    q, k, v = q.reshape(-1, nq, d), k.reshape(-1, nk, d), v.reshape(-1, nk, dv)
    recompute = int(p_all.numel() == 0)
    bh = q.shape[0]
    step = step if step > 0 else _step(q, k, THRESHOLDS.periodic_chunk_bytes)
    _, bwd, fin = _functions(lib, q.dtype)
    threads = torch.get_num_threads()
    do = dout.to(q.dtype).contiguous().view(bh, nq, dv)
    gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rs, colsums = q.new_empty(bh, nq), q.new_empty(2, bh, nk)  # Σ_j E; (Σ_i E, Σ_i dL)
    per = min(step, bh)
    s_buf = q.new_empty(per, nq, nk) if recompute else None  # sin θ/θ is used at once, not stored
    dp_buf = q.new_empty(per, nq, nk)
    pq, pdo, pout, paux = q.data_ptr(), do.data_ptr(), out.data_ptr(), aux.data_ptr()
    pshift, prinv = state.data_ptr(), _address(state, bh * nq)
    prs, pcs, pdls = rs.data_ptr(), colsums.data_ptr(), _address(colsums, bh * nk)
    pm, msg, msi = (None, 0, 0) if mask is None else (mask.data_ptr(), mask.stride(0), mask.stride(1))
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
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
        _check_px("px_bwd", pw, None if recompute else sc_all, dp, q, k, None, mask, rep, aux,
                  state, h0, h1,
                  do, out, rs, colsums)
        ps, pdp = pw.data_ptr(), dp.data_ptr()

        def rows(a: int, b: int, ps: int = ps, psc: int | None = psc, pdp: int = pdp, h0: int = h0
                 ) -> None:
            bwd(ps, psc, pdp, recompute, pq, pdo, pout, dv, pm, msg, msi, rep, paux, pshift, prinv,
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
            fin(pgq, pq, prs, pgk, pk, pcs, pdls, a, b, nq, nk, d, c * om2, s)

        _run(finish, bh, (nq + nk) * d, threads)
    ge = colsums[1].unsqueeze(1) if need_e else q.new_empty(0)
    return (gq.view(sq) if need_q else q.new_empty(0), gk.view(sk) if need_k else k.new_empty(0), gv.view(sv),
            ge)  # (a gradient not needed: empty, never unwritten memory)




class _NativePeriodic(torch.autograd.Function):
    """:func:`periodic_forward` / :func:`periodic_backward` as one autograd node (plain eager calls);
    ``lead``: the output's batch dims."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None,
        rep: int, om2: float, c: float, s: float, save: bool, step: int, lead: tuple[int, ...],
    ) -> Tensor:
        out, aux, state, p, sc = periodic_forward(q, k, v, e, mask, rep, om2, c, s, save, step)
        ctx.args = rep, om2, c, s, step
        ctx.save_for_backward(q, k, v, mask, aux, state, out, p, sc)
        return out.view(*lead, *out.shape[-2:])

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "kernel_attention (fused Expsin)",
                               "use kernel_weights(q, k, kernel=...) @ v")
        need_q, need_k, need_v, need_e = ctx.needs_input_grad[:4]
        q, k, v, mask, aux, state, out, p, sc = ctx.saved_tensors
        rep, om2, c, s, step = ctx.args
        gq, gk, gv, ge = periodic_backward(dout, q, k, v, mask, aux, state, out, p, sc, rep, om2, c, s, step,
                                           need_q, need_k, need_e)
        return (gq if need_q else None, gk if need_k else None, gv if need_v else None,
                ge if need_e else None, None, None, None, None, None, None, None, None)


def native_periodic_attention(
    _lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int,
    om2: float, c: float, s: float, save: bool, chunk_bytes: int, batch: tuple[int, ...],
) -> Tensor:
    """:class:`.periodic._FusedPeriodic`'s arguments, through the C passes of ``lib``
    (:func:`library`); heads are taken ``chunk_bytes`` of scores per thread at a time. Returns
    ``(*batch, Nq, dv)``."""
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    out: Tensor = _NativePeriodic.apply(q, k, v, e, mask, rep, om2, c, s, save, _step(q, k, chunk_bytes),
                                        batch)
    return out


def _step(q: Tensor, k: Tensor, chunk_bytes: int) -> int:
    """Heads per chunk: ``chunk_bytes`` of scores per thread."""
    block = q.shape[-2] * k.shape[-2] * q.element_size()
    return max(1, chunk_bytes * max(1, torch.get_num_threads()) // max(block, 1))


def traced_periodic_attention(
    q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int, om2: float, c: float,
    s: float, save: bool, batch: tuple[int, ...],
) -> Tensor:
    """:func:`native_periodic_attention` while ``torch.compile`` / ``torch.export`` traces: the op
    ``attnopt::px_fwd`` (backward ``attnopt::px_bwd`` by its ``register_autograd``), one node in the
    graph (``chunk_bytes``: THRESHOLDS.periodic_chunk_bytes, which the op reads at run time). Returns
    ``(*batch, Nq, dv)``."""
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    # (step 0: the op body takes the chunk from THRESHOLDS and the thread count at run time: the thread
    # count is not a traceable value)
    out = torch.ops.attnopt.px_fwd(q, k, v, e, mask, rep, om2, c, s, save, 0)[0]
    return out.view(*batch, *out.shape[-2:])


# --- the passes as torch.library ops (issue 30 item 2) ---------------------------------------------


@torch.library.custom_op("attnopt::px_fwd", mutates_args=(), device_types="cpu")
def px_fwd(
    q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int, om2: float, c: float,
    s: float, save: bool, step: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out (BH, Nq, dv), aux, state, P or empty, sin θ/θ or empty)`` (:func:`periodic_forward`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return periodic_forward(q, k, v, e, mask, rep, om2, c, s, save, step)


@px_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None, rep: int,  # noqa: ARG001
      om2: float, c: float, s: float, save: bool, step: int,  # noqa: ARG001
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    bh = q.numel() // max(nq * q.shape[-1], 1)
    big = (bh, nq, nk) if save else (0,)
    return (q.new_empty(bh, nq, dv), q.new_empty(bh, 2, nk), q.new_empty(2, bh, nq), q.new_empty(big),
            q.new_empty(big))


@torch.library.custom_op("attnopt::px_bwd", mutates_args=(), device_types="cpu")
def px_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, aux: Tensor, state: Tensor,
    out: Tensor, p_all: Tensor, sc_all: Tensor, rep: int, om2: float, c: float, s: float, step: int,
    need_q: bool, need_k: bool, need_e: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d e)`` of :func:`px_fwd` (:func:`periodic_backward`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gq, gk, gv, ge = periodic_backward(dout, q, k, v, mask, aux, state, out, p_all, sc_all, rep, om2, c, s,
                                       step, need_q, need_k, need_e)
    return gq, gk, gv, ge.clone()  # (ge: a view into a scratch buffer; an op's output owns its storage)


@px_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, aux: Tensor,  # noqa: ARG001
      state: Tensor, out: Tensor, p_all: Tensor, sc_all: Tensor, rep: int, om2: float,  # noqa: ARG001
      c: float, s: float, step: int, need_q: bool, need_k: bool,  # noqa: ARG001
      need_e: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    bh, nk = aux.shape[0], k.shape[-2]
    return (q.new_empty(q.shape if need_q else (0,)), k.new_empty(k.shape if need_k else (0,)),
            v.new_empty(v.shape), q.new_empty((bh, 1, nk) if need_e else (0,)))


def _px_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, _, mask, rep, om2, c, s, _, step = inputs
    out, aux, state, p, sc = output
    ctx.args = rep, om2, c, s, step
    ctx.save_for_backward(q, k, v, mask, aux, state, out, p, sc)


def _px_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    need_q, need_k, need_v, need_e = ctx.needs_input_grad[:4]
    saved = ctx.saved_tensors
    gq, gk, gv, ge = torch.ops.attnopt.px_bwd(dout, *saved, *ctx.args, need_q, need_k, need_e)
    return (gq if need_q else None, gk if need_k else None, gv if need_v else None, ge if need_e else None,
            None, None, None, None, None, None, None)


px_fwd.register_autograd(_px_backward, setup_context=_px_setup)
