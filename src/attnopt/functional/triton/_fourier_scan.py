r"""Causal linear-mode implicit-kernel attention as a chunked scan in Triton (internal).

implicit-kernel-attention §4 with the random Fourier features of :mod:`._fourier`
(``φ = [φ_cos, φ_sin]``, ``2R`` wide): ``f² = ⟨φ(q)⊗φ(q), φ(k)⊗φ(k)⟩``, so for a key log-weight
``a_j`` (magnitude and key mask; ``-inf`` = excluded) and ``V1_j = [v_j, 1]``

.. math:: n_i = \sum_{j\le i} (x_{ij}^2 + \varepsilon)\, e^{a_j - c_i} V1_j,\qquad
          \mathrm{out}_i = n_{i,:dv} / n_{i,dv},

with ``c_i = max_{j≤i} a_j`` the row's running max (no row underflows), exactly
:func:`attnopt.functional.kernel_linear.linear_kernel_attention`'s causal form. One program per
(batch, head) walks the sequence chunk by chunk (``CH`` rows): inside a chunk the exact
``CH × CH`` block, for earlier keys the carried state

.. math:: S[a, b, :] = \sum_{j < \text{chunk}} e^{a_j - c_\text{prev}}\, \phi_{ja}\phi_{jb}\, V1_j,
          \qquad e = \sum_{j < \text{chunk}} e^{a_j - c_\text{prev}} V1_j

(the per-chunk prefix sums of ``(φ(k)⊗φ(k))ᵀ V1``), read as ``e^{c_prev − c_i}(Σ_ab φ_ia φ_ib S_ab
+ ε e)``. ``S`` (``2R × 2R × (dv+1)`` per head) lives in a scratch buffer, its value columns
(``dv`` padded to a power of two) and its denominator column (``V1``'s 1) kept apart so that a
power-of-two ``dv`` is not padded to twice its width; one ``2R × (dv+1)`` slice per feature ``a``
is read and written per chunk; the
features are made from the ``q``/``k`` tiles in the kernel. Time O(N·R²·dv), memory O(N) plus the
state. Saved for the backward: the output, ``c_i`` and the denominator ``n_{i,dv}`` (O(N)).

Backward, with ``g_i = [do_i, −do_i·out_i] / n_{i,dv}`` (``dL/dn_i``; 0 for a row with no key),
``G_ij = g_i·V1_j``, ``dx_ij = 2 G_ij x_ij e^{a_j − c_i}``, ``da_j = Σ_i G_ij w_ij``,
``dV1_j = Σ_i w_ij g_i``: a forward scan for the queries (``dφ_i[a] += 2 e^{c_prev − c_i}
Σ_b φ_ib S[a,b,:]·g_i`` plus the chunk's block), and a reverse scan for the keys with the state
``P[a,b,:] = Σ_{i after the chunk} e^{c_end − c_i} φ_ia φ_ib g_i`` (``c_end`` the running max at the
chunk's end; every factor ≤ 1): ``dV1_j += m_j Σ_ab φ_ja φ_jb P_ab``, ``dφ_j[a] += 2 m_j
Σ_b φ_jb P[a,b,:]·V1_j``, ``m_j = e^{a_j − c_end}``. The features' chain to ``q``, ``k`` and the points
is :func:`._fourier._points_grad`'s. ``torch.library.triton_op`` ops (``attnopt::triton_ika_scan``).

Every product runs in the accumulator dtype with IEEE precision (float32 for half inputs, never
TF32), as ``φᵀSφ`` cancels to the much smaller ``Σ_j m_j f_ij²``. One program per (batch, head):
the scan is sequential in N, so at small ``B·H`` the GPU is mostly idle (splitting ``S`` over
programs by feature slices, with the row sums combined afterwards, is the tuning step left).
"""
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from attnopt.functional.triton._flash import BLOCKS, INTERPRETED, _meta, _pow2
from attnopt.functional.triton._fourier import (
    _input_grad,
    _key_side,
    _load_scalars,
    _scalars,
    _side,
    magnitude_mode,
)
from attnopt.functional.triton._tiles import _load_tile, _store_rows, _store_tile

__all__ = ["ika_causal_scan"]


@triton.jit
def _column(c, s, offs_r, a, R):
    """Column ``a`` of the features ``[c, s]`` (``a < R``: of ``c``; else ``s``'s ``a − R``)."""
    first = tl.sum(tl.where((offs_r == a)[None, :], c, 0.0), 1)
    return first + tl.sum(tl.where((offs_r == a - R)[None, :], s, 0.0), 1)


@triton.jit
def _chunk(Q, K, V, W, CB, ob, oh, start, N, DA, DVA, R, sqb, sqh, sqn, sqd, skb, skh, skn, skd,
           svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn, coef, half_s, p, cap,
           CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr,
           S: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """One chunk's tiles: ``(q, k, v, a, φ_cos(q), φ_sin(q), u_q0, u_q1, φ_cos(k), φ_sin(k), u_k0,
    u_k1)`` (``v`` zero-padded to ``EP`` columns, ``a`` the key log-weight, ``-inf`` past ``N``)."""
    offs = start + tl.arange(0, CH)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, RP)
    w_ptr = W + ob * swb + oh * swh
    q, cq, sq, uq0, uq1 = _side(Q, ob, oh, sqb, sqh, sqn, sqd, offs, N, w_ptr, swr, swd, offs_r, offs_d, R,
                                DA, coef, S, ACC, PREC)
    k, ck, sk, uk0, uk1, a = _key_side(
        K, ob, oh, skb, skh, skn, skd, offs, N, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef,
        CB + ob * scb + oh * sch + offs * scn, half_s, p, cap, MAG, S, ACC, PREC)
    v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs, N, tl.arange(0, EP), DVA).to(ACC)
    return q, k, v, a, cq, sq, uq0, uq1, ck, sk, uk0, uk1


@triton.jit
def _factor(c_prev, c_row, CH: tl.constexpr, ACC: tl.constexpr):
    """``e^{c_prev − c_i}`` per row (0 where either is ``-inf``: nothing to carry)."""
    cp = c_prev + tl.zeros([CH], ACC)
    ok = (c_row > float("-inf")) & (cp > float("-inf"))
    return tl.where(ok, tl.exp(tl.where(ok, cp, 0.0) - tl.where(ok, c_row, 0.0)), 0.0)


@triton.jit
def _block(cq, sq, ck, sk, a, c_row, CH: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """The chunk's ``CH × CH`` block: ``(x, e)`` with ``e_ij = e^{a_j − c_i}`` on ``j ≤ i`` (else 0)."""
    x = tl.dot(cq, tl.trans(ck), out_dtype=ACC, input_precision=PREC)
    x += tl.dot(sq, tl.trans(sk), out_dtype=ACC, input_precision=PREC)
    loc = tl.arange(0, CH)
    ok = (loc[None, :] <= loc[:, None]) & (a[None, :] > float("-inf")) & (c_row[:, None] > float("-inf"))
    lw = a[None, :] - tl.where(c_row > float("-inf"), c_row, 0.0)[:, None]
    e = tl.where(ok, tl.exp(tl.minimum(tl.where(ok, lw, 0.0), 0.0)), 0.0)
    return x, e


@triton.jit
def _program(ST, ZT, H, R, CH: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr):
    """A program's ``(pid_g, ob, oh)`` (one (batch, head) on the grid ``(B·H,)``), its scratch state
    ``(st, zt)`` (:func:`_slice`), and the offsets of a chunk's rows and of the features."""
    pid_g = tl.program_id(0)
    return (pid_g, pid_g // H, pid_g % H, ST + pid_g * (2 * R * 2 * RP * EP), ZT + pid_g * (2 * R * 2 * RP),
            tl.arange(0, CH), tl.arange(0, RP))


@triton.jit
def _slice(st, zt, f, RP: tl.constexpr, EP: tl.constexpr):
    """Pointers to slice ``f`` of a scan state: the ``(RP, EP)`` value blocks of the cos and the sin
    features (``S[f, :R]``, ``S[f, R:]``) and their ``(RP,)`` denominator entries."""
    offs_r = tl.arange(0, RP)
    base = st + f * (2 * RP * EP)
    s_ptrs = offs_r[:, None] * EP + tl.arange(0, EP)[None, :]
    zb = zt + f * (2 * RP)
    return base + s_ptrs, base + RP * EP + s_ptrs, zb + offs_r, zb + RP + offs_r


@triton.jit
def _load_slice(st, zt, f, RP: tl.constexpr, EP: tl.constexpr):
    """Slice ``f`` of a scan state (:func:`_slice`): ``(s_cos, s_sin, z_cos, z_sin)``."""
    pc, ps, zc, zs = _slice(st, zt, f, RP, EP)
    return tl.load(pc), tl.load(ps), tl.load(zc), tl.load(zs)


@triton.jit
def _carry(st, zt, f, s_c, s_s, z_c, z_s, decay, c, s, col, rhs, wt, RP: tl.constexpr, EP: tl.constexpr,
           ACC: tl.constexpr, PREC: tl.constexpr):
    """Slice ``f`` of a scan state, read as ``(s_c, s_s, z_c, z_s)``, moved past the chunk and
    written back: ``S ← decay·S + (φ φ_f)ᵀ rhs``, ``z ← decay·z + Σ_rows φ φ_f wt`` for the
    features ``φ = [c, s]`` of the chunk's rows entering the state and their column ``f`` (``col``):
    keys with ``(V1·m, m)`` in the forward scans, queries with ``(g·r, g_d·r)`` in the reverse one."""
    cm = c * col[:, None]
    sm = s * col[:, None]
    s_c = s_c * decay + tl.dot(tl.trans(cm), rhs, out_dtype=ACC, input_precision=PREC)
    s_s = s_s * decay + tl.dot(tl.trans(sm), rhs, out_dtype=ACC, input_precision=PREC)
    z_c = z_c * decay + tl.sum(cm * wt[:, None], 0)
    z_s = z_s * decay + tl.sum(sm * wt[:, None], 0)
    pc, ps, zc, zs = _slice(st, zt, f, RP, EP)
    tl.debug_barrier()  # every warp has read the slice before it is overwritten
    tl.store(pc, s_c)
    tl.store(ps, s_s)
    tl.store(zc, z_c)
    tl.store(zs, z_s)


@triton.jit
def _chunk_end(c_prev, a):
    """``(c_end, decay, m)``: the running max at the chunk's end ``max(c_prev, max_j a_j)``, the
    state's factor ``e^{c_prev − c_end}`` and the chunk's ``m_j = e^{a_j − c_end}`` (0 where a
    log-weight is ``-inf``)."""
    c_end = tl.maximum(c_prev, tl.max(a, 0))
    end_ok = c_end > float("-inf")
    c_end_s = tl.where(end_ok, c_end, 0.0)
    decay = tl.where(end_ok, tl.where(c_prev > float("-inf"), tl.exp(c_prev - c_end_s), 0.0), 0.0)
    return c_end, decay, tl.where(a > float("-inf"), tl.exp(a - c_end_s), 0.0)


@triton.jit
def _add_column(dc, ds_, col, offs_r, f, R):
    """``(dc, ds_)`` with ``col`` added to column ``f`` of ``[dc, ds_]`` (``f < R``: of ``dc``)."""
    return (dc + tl.where((offs_r == f)[None, :], col[:, None], 0.0),
            ds_ + tl.where((offs_r == f - R)[None, :], col[:, None], 0.0))


@triton.jit
def _fwd_kernel(
    Q, K, V, W, CB, O, CR, DEN, ST, ZT, SC, H, N, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    sob, soh, son, sod,
    CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """The output, ``c_i`` and the denominator ``n_{i,dv}`` of one (batch, head): the forward scan."""
    coef, eps, half_s, p, cap = _load_scalars(SC)
    pid_g, ob, oh, st, zt, loc, offs_r = _program(ST, ZT, H, R, CH, EP, RP)
    c_prev = tl.max(tl.full([CH], float("-inf"), ACC), 0)
    esum = tl.zeros([EP], ACC)
    zsum = tl.sum(tl.zeros([CH], ACC), 0)
    for start in range(0, N, CH):
        offs = start + loc
        _q, _k, v, a, cq, sq, _a0, _a1, ck, sk, _b0, _b1 = _chunk(
            Q, K, V, W, CB, ob, oh, start, N, DA, DVA, R, sqb, sqh, sqn, sqd, skb, skh, skn, skd,
            svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn, coef, half_s, p, cap, CH, D, EP, RP, MAG,
            S, ACC, PREC)
        tri = loc[None, :] <= loc[:, None]
        c_row = tl.maximum(tl.max(tl.where(tri, a[None, :], float("-inf")), 1), c_prev)
        carry = _factor(c_prev, c_row, CH, ACC)
        x, e = _block(cq, sq, ck, sk, a, c_row, CH, ACC, PREC)
        w = (x * x + eps) * e
        num = tl.dot(w, v, out_dtype=ACC, input_precision=PREC)
        den = tl.sum(w, 1)
        c_end, decay, mk = _chunk_end(c_prev, a)
        vm = v * mk[:, None]
        inter = tl.zeros([CH, EP], ACC) + eps * esum[None, :]
        inter_d = tl.zeros([CH], ACC) + eps * zsum
        for f in range(0, 2 * R):
            s_c, s_s, z_c, z_s = _load_slice(st, zt, f, RP, EP)
            colq = _column(cq, sq, offs_r, f, R)
            inter += colq[:, None] * (tl.dot(cq, s_c, out_dtype=ACC, input_precision=PREC)
                                      + tl.dot(sq, s_s, out_dtype=ACC, input_precision=PREC))
            inter_d += colq * tl.sum(cq * z_c[None, :] + sq * z_s[None, :], 1)
            _carry(st, zt, f, s_c, s_s, z_c, z_s, decay, ck, sk, _column(ck, sk, offs_r, f, R), vm, mk, RP,
                   EP, ACC, PREC)
        tl.debug_barrier()
        num += carry[:, None] * inter
        den += carry * inter_d
        esum = esum * decay + tl.sum(vm, 0)
        zsum = zsum * decay + tl.sum(mk, 0)
        c_prev = c_end
        ok = den > 0
        out = tl.where(ok[:, None], num / tl.where(ok, den, 1.0)[:, None], 0.0)
        _store_tile(O, ob, oh, sob, soh, son, sod, offs, N, tl.arange(0, EP), DVA, out)
        tl.store(CR + pid_g * N + offs, c_row, mask=offs < N)
        tl.store(DEN + pid_g * N + offs, den, mask=offs < N)


@triton.jit
def _row_grad(DO, O, DEN, ob, oh, pid_g, offs, N, DVA, sob, soh, son, sod, EP: tl.constexpr,
              ACC: tl.constexpr):
    """``(g_v, g_d)``: ``g_i = [do_i, −do_i·out_i] / den_i`` split in its value and denominator
    parts (0 for a row with no admissible key)."""
    offs_e = tl.arange(0, EP)
    do = _load_tile(DO, ob, oh, sob, soh, son, sod, offs, N, offs_e, DVA).to(ACC)
    out = _load_tile(O, ob, oh, sob, soh, son, sod, offs, N, offs_e, DVA)
    den = tl.load(DEN + pid_g * N + offs, mask=offs < N, other=0.0)
    ok = den > 0
    inv = tl.where(ok, 1.0 / tl.where(ok, den, 1.0), 0.0)
    return do * inv[:, None], -tl.sum(do * out.to(ACC), 1) * inv


@triton.jit
def _bwd_queries_kernel(
    Q, K, V, W, CB, DO, O, CR, DEN, DQ, DW, ST, ZT, SC, H, N, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    sob, soh, son, sod,
    CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``dq`` and the queries' share of ``dW``: the forward scan again, with ``S`` rebuilt."""
    coef, eps, half_s, p, cap = _load_scalars(SC)
    pid_g, ob, oh, st, zt, loc, offs_r = _program(ST, ZT, H, R, CH, EP, RP)
    c_prev = tl.max(tl.full([CH], float("-inf"), ACC), 0)
    for start in range(0, N, CH):
        offs = start + loc
        q, _k, v, a, cq, sq, uq0, uq1, ck, sk, _b0, _b1 = _chunk(
            Q, K, V, W, CB, ob, oh, start, N, DA, DVA, R, sqb, sqh, sqn, sqd, skb, skh, skn, skd,
            svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn, coef, half_s, p, cap, CH, D, EP, RP, MAG,
            S, ACC, PREC)
        c_row = tl.load(CR + pid_g * N + offs, mask=offs < N, other=float("-inf"))
        g, gd = _row_grad(DO, O, DEN, ob, oh, pid_g, offs, N, DVA, sob, soh, son, sod, EP, ACC)
        carry = _factor(c_prev, c_row, CH, ACC)
        x, e = _block(cq, sq, ck, sk, a, c_row, CH, ACC, PREC)
        gg = tl.dot(g, tl.trans(v), out_dtype=ACC, input_precision=PREC) + gd[:, None]
        dx = 2.0 * gg * x * e
        dcq = tl.dot(dx, ck, out_dtype=ACC, input_precision=PREC)
        dsq = tl.dot(dx, sk, out_dtype=ACC, input_precision=PREC)
        c_end, decay, mk = _chunk_end(c_prev, a)
        vm = v * mk[:, None]
        for f in range(0, 2 * R):
            s_c, s_s, z_c, z_s = _load_slice(st, zt, f, RP, EP)
            hc = tl.dot(g, tl.trans(s_c), out_dtype=ACC, input_precision=PREC) + gd[:, None] * z_c[None, :]
            hs = tl.dot(g, tl.trans(s_s), out_dtype=ACC, input_precision=PREC) + gd[:, None] * z_s[None, :]
            dcq, dsq = _add_column(dcq, dsq, 2.0 * carry * tl.sum(cq * hc + sq * hs, 1), offs_r, f, R)
            _carry(st, zt, f, s_c, s_s, z_c, z_s, decay, ck, sk, _column(ck, sk, offs_r, f, R), vm, mk, RP,
                   EP, ACC, PREC)
        tl.debug_barrier()
        c_prev = c_end
        # MAG = 0: no magnitude term for queries (its ``da`` argument is then unused)
        _input_grad(DQ, q, dcq, dsq, uq0, uq1, dcq, pid_g * N + offs, offs, N, W + ob * swb + oh * swh, swr,
                    swd, offs_r, tl.arange(0, D), R, DA, coef, DW + pid_g * S * R * D, half_s, p, cap, 0, D,
                    S, ACC, PREC)


@triton.jit
def _bwd_keys_kernel(
    Q, K, V, W, CB, DO, O, CR, DEN, DK, DV_, DCB, DW, ST, ZT, SC, H, N, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    sob, soh, son, sod,
    CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``dk``, ``dv``, ``dcb`` and the keys' share of ``dW``: a reverse scan with the state ``P``."""
    coef, eps, half_s, p, cap = _load_scalars(SC)
    pid_g, ob, oh, st, zt, loc, offs_r = _program(ST, ZT, H, R, CH, EP, RP)
    pe = tl.zeros([EP], ACC)
    pe_d = tl.sum(tl.zeros([CH], ACC), 0)
    chunks = tl.cdiv(N, CH)
    for it in range(0, chunks):
        start = (chunks - 1 - it) * CH
        offs = start + loc
        _q, k, v, a, cq, sq, _a0, _a1, ck, sk, uk0, uk1 = _chunk(
            Q, K, V, W, CB, ob, oh, start, N, DA, DVA, R, sqb, sqh, sqn, sqd, skb, skh, skn, skd,
            svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn, coef, half_s, p, cap, CH, D, EP, RP, MAG,
            S, ACC, PREC)
        c_row = tl.load(CR + pid_g * N + offs, mask=offs < N, other=float("-inf"))
        first = (loc == 0) & (start > 0)  # the running max before the chunk: the previous row's
        c_prev = tl.max(tl.load(CR + pid_g * N + start - 1 + 0 * loc, mask=first, other=float("-inf")), 0)
        g, gd = _row_grad(DO, O, DEN, ob, oh, pid_g, offs, N, DVA, sob, soh, son, sod, EP, ACC)
        _c_end, decay, m = _chunk_end(c_prev, a)
        r = _factor(c_prev, c_row, CH, ACC)
        gr = g * r[:, None]
        grd = gd * r
        # the chunk's block
        x, e = _block(cq, sq, ck, sk, a, c_row, CH, ACC, PREC)
        w = (x * x + eps) * e
        gg = tl.dot(g, tl.trans(v), out_dtype=ACC, input_precision=PREC) + gd[:, None]
        dv = tl.dot(tl.trans(w), g, out_dtype=ACC, input_precision=PREC) + eps * m[:, None] * pe[None, :]
        da = tl.sum(gg * w, 0) + eps * m * (tl.sum(pe[None, :] * v, 1) + pe_d)
        dxt = tl.trans(2.0 * gg * x * e)
        dck = tl.dot(dxt, cq, out_dtype=ACC, input_precision=PREC)
        dsk = tl.dot(dxt, sq, out_dtype=ACC, input_precision=PREC)
        # later queries through P (referenced to c_end), then P moves to c_prev with this chunk's queries
        for f in range(0, 2 * R):
            p_c, p_s, pz_c, pz_s = _load_slice(st, zt, f, RP, EP)
            colk = _column(ck, sk, offs_r, f, R)
            y = tl.dot(ck, p_c, out_dtype=ACC, input_precision=PREC) + tl.dot(sk, p_s, out_dtype=ACC,
                                                                              input_precision=PREC)
            yv = tl.sum(y * v, 1) + tl.sum(ck * pz_c[None, :] + sk * pz_s[None, :], 1)
            dv += (m * colk)[:, None] * y
            da += m * colk * yv
            dck, dsk = _add_column(dck, dsk, 2.0 * m * yv, offs_r, f, R)
            _carry(st, zt, f, p_c, p_s, pz_c, pz_s, decay, cq, sq, _column(cq, sq, offs_r, f, R), gr, grd, RP,
                   EP, ACC, PREC)
        tl.debug_barrier()
        pe = pe * decay + tl.sum(gr, 0)
        pe_d = pe_d * decay + tl.sum(grd, 0)
        rows = pid_g * N + offs
        _input_grad(DK, k, dck, dsk, uk0, uk1, da, rows, offs, N, W + ob * swb + oh * swh, swr, swd, offs_r,
                    tl.arange(0, D), R, DA, coef, DW + pid_g * S * R * D, half_s, p, cap, MAG, D, S, ACC,
                    PREC)
        _store_rows(DV_, rows, offs, N, dv, EP, DVA)
        tl.store(DCB + rows, da, mask=offs < N)


def _chunk_rows() -> int:
    if BLOCKS[0] is not None:
        return BLOCKS[0][0]
    return 16 if INTERPRETED else 64


def _launch_meta(q: Tensor, v: Tensor, w: Tensor, sets: int) -> tuple[int, dict[str, Any]]:
    acc, _prec = _meta(q)  # every product in the accumulator dtype, IEEE (no TF32): the linear form
    # amplifies rounding (kernel_linear's docstring), so the scan never rounds its operands to 10 bits
    prec = "ieee"
    r = w.shape[2] // sets
    return r, dict(CH=_chunk_rows(), D=_pow2(q.shape[3]), EP=_pow2(v.shape[3]), RP=_pow2(r), S=sets,
                   ACC=acc, PREC=prec, num_warps=4, num_stages=1)


def _state(q: Tensor, r: int, meta: dict[str, Any], pot: torch.dtype) -> tuple[Tensor, Tensor]:
    """The scan's scratch state: per (batch, head) ``2R`` slices of ``2 × RP × EP`` (values) and
    of ``2 × RP`` (the denominator's)."""
    bh = q.shape[0] * q.shape[1]
    return (torch.zeros((bh, 2 * r, 2, meta["RP"], meta["EP"]), dtype=pot, device=q.device),
            torch.zeros((bh, 2 * r, 2, meta["RP"]), dtype=pot, device=q.device))


@triton_op("attnopt::triton_ika_scan", mutates_args=())
def _scan_fwd(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, mag: int, p: float, scale: float, eps: float,
    coef: float, sets: int,
) -> tuple[Tensor, Tensor, Tensor]:
    batch, heads, n, d = q.shape
    dv = v.shape[3]
    pot = cb.dtype
    r, meta = _launch_meta(q, v, w, sets)
    out = q.new_empty((batch, heads, n, dv))
    c_row = torch.empty((batch, heads, n), dtype=pot, device=q.device)
    den = torch.empty((batch, heads, n), dtype=pot, device=q.device)
    wrap_triton(_fwd_kernel)[(batch * heads,)](
        q, k, v, w, cb, out, c_row, den, *_state(q, r, meta, pot),
        _scalars(pot, q.device, coef, eps, scale, p), heads, n, d, dv, r, *q.stride(), *k.stride(),
        *v.stride(), *w.stride(), *cb.stride(), *out.stride(),
        MAG=mag, **meta)
    return out, c_row, den


@triton_op("attnopt::triton_ika_scan_backward", mutates_args=())
def _scan_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, out: Tensor, c_row: Tensor,
    den: Tensor, mag: int, p: float, scale: float, eps: float, coef: float, sets: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    batch, heads, n, d = q.shape
    dv = v.shape[3]
    pot = cb.dtype
    r, meta = _launch_meta(q, v, w, sets)
    do = dout.to(q.dtype).contiguous()
    outc = out.contiguous()
    gq = torch.empty((batch, heads, n, meta["D"]), dtype=q.dtype, device=q.device)
    gk = torch.empty((batch, heads, n, meta["D"]), dtype=q.dtype, device=q.device)
    gv = torch.empty((batch, heads, n, meta["EP"]), dtype=q.dtype, device=q.device)
    gcb = torch.empty((batch, heads, n), dtype=pot, device=q.device)
    gw = torch.zeros((batch, heads, sets * r, meta["D"]), dtype=pot, device=q.device)
    sc = _scalars(pot, q.device, coef, eps, scale, p)
    strides = (*q.stride(), *k.stride(), *v.stride(), *w.stride(), *cb.stride(), *outc.stride())
    wrap_triton(_bwd_queries_kernel)[(batch * heads,)](
        q, k, v, w, cb, do, outc, c_row, den, gq, gw, *_state(q, r, meta, pot), sc, heads, n, d, dv, r,
        *strides, MAG=mag, **meta)
    wrap_triton(_bwd_keys_kernel)[(batch * heads,)](
        q, k, v, w, cb, do, outc, c_row, den, gk, gv, gcb, gw, *_state(q, r, meta, pot), sc, heads, n, d, dv,
        r, *strides, MAG=mag, **meta)
    return gq[..., :d], gk[..., :d], gv[..., :dv], gw[..., :d].to(w.dtype), gcb


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, w, cb, *rest = inputs
    ctx.rest = rest
    ctx.save_for_backward(q, k, v, w, cb, *output)


def _backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    q, k, v, w, cb, out, c_row, den = ctx.saved_tensors
    gq, gk, gv, gw, gcb = _scan_bwd(dout, q, k, v, w, cb, out, c_row, den, *ctx.rest)
    return (gq, gk, gv, gw, gcb) + (None,) * 6


_scan_fwd.register_autograd(_backward, setup_context=_setup)


def ika_causal_scan(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, *, magnitude_p: float | None, scale: float,
    eps: float, coef: float, sets: int,
) -> Tensor:
    """Causal linear-mode output (module docstring).

    Args:
        q, k: (B, H, N, d). v: (B, H, N, dv), one dtype.
        w: (B, H, S·R, d) points in the potential dtype (stride 0 where they broadcast).
        cb: (B, H, N) key log-weight in the potential dtype (key mask, and the magnitude where
            :func:`._fourier.magnitude_mode` is -1), ``-inf`` = excluded; differentiable.
        magnitude_p: ``p`` of the in-kernel magnitude, or None.
        scale: ``s`` of the magnitude. eps: ``ε``. coef: the features' ``c``. sets: ``S``.
    Returns:
        (B, H, N, dv) in ``q``'s dtype; a row with no admissible key is 0.
    """
    mag = magnitude_mode(magnitude_p)
    if mag < 0:
        raise ValueError(f"the scan computes magnitude_p in [1, 2] or None, got {magnitude_p}")
    p = 2.0 if magnitude_p is None else float(magnitude_p)
    return _scan_fwd(q, k, v, w, cb, mag, p, float(scale), float(eps), float(coef), int(sets))[0]
