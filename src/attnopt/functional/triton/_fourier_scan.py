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
    _features,
    _key_side,
    _load_scalars,
    _magnitude,
    _points_grad,
    _scalars,
    magnitude_mode,
)

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
    offs_e = tl.arange(0, EP)
    offs_r = tl.arange(0, RP)
    w_ptr = W + ob * swb + oh * swh
    q = tl.load(Q + ob * sqb + oh * sqh + offs[:, None] * sqn + offs_d[None, :] * sqd,
                mask=(offs[:, None] < N) & (offs_d[None, :] < DA), other=0.0)
    cq, sq, uq0, uq1 = _features(q, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, S, ACC, PREC)
    k, ck, sk, uk0, uk1, a = _key_side(
        K + ob * skb + oh * skh + offs[:, None] * skn + offs_d[None, :] * skd, w_ptr,
        CB + ob * scb + oh * sch + offs * scn, offs, offs_d, offs_r, N, DA, R, swr, swd, coef, half_s, p, cap,
        MAG, S, ACC, PREC)
    v = tl.load(V + ob * svb + oh * svh + offs[:, None] * svn + offs_e[None, :] * svd,
                mask=(offs[:, None] < N) & (offs_e[None, :] < DVA), other=0.0).to(ACC)
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
def _fwd_kernel(
    Q, K, V, W, CB, O, CR, DEN, ST, ZT, SC, H, N, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    sob, soh, son, sod,
    CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_g = tl.program_id(0)
    ob = pid_g // H
    oh = pid_g % H
    coef, eps, half_s, p, cap = _load_scalars(SC)
    offs_e = tl.arange(0, EP)
    offs_r = tl.arange(0, RP)
    loc = tl.arange(0, CH)
    st = ST + pid_g * (2 * R * 2 * RP * EP)
    zt = ZT + pid_g * (2 * R * 2 * RP)
    s_ptrs = offs_r[:, None] * EP + offs_e[None, :]
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
        c_end = tl.maximum(c_prev, tl.max(a, 0))
        end_ok = c_end > float("-inf")
        c_end_s = tl.where(end_ok, c_end, 0.0)
        decay = tl.where(end_ok, tl.where(c_prev > float("-inf"), tl.exp(c_prev - c_end_s), 0.0), 0.0)
        mk = tl.where(a > float("-inf"), tl.exp(a - c_end_s), 0.0)
        vm = v * mk[:, None]
        inter = tl.zeros([CH, EP], ACC) + eps * esum[None, :]
        inter_d = tl.zeros([CH], ACC) + eps * zsum
        for f in range(0, 2 * R):
            colq = _column(cq, sq, offs_r, f, R)
            colk = _column(ck, sk, offs_r, f, R)
            base = st + f * (2 * RP * EP)
            s_c = tl.load(base + s_ptrs)
            s_s = tl.load(base + RP * EP + s_ptrs)
            zb = zt + f * (2 * RP)
            z_c = tl.load(zb + offs_r)
            z_s = tl.load(zb + RP + offs_r)
            inter += colq[:, None] * (tl.dot(cq, s_c, out_dtype=ACC, input_precision=PREC)
                                      + tl.dot(sq, s_s, out_dtype=ACC, input_precision=PREC))
            inter_d += colq * tl.sum(cq * z_c[None, :] + sq * z_s[None, :], 1)
            ckm = ck * colk[:, None]
            skm = sk * colk[:, None]
            s_c = s_c * decay + tl.dot(tl.trans(ckm), vm, out_dtype=ACC, input_precision=PREC)
            s_s = s_s * decay + tl.dot(tl.trans(skm), vm, out_dtype=ACC, input_precision=PREC)
            z_c = z_c * decay + tl.sum(ckm * mk[:, None], 0)
            z_s = z_s * decay + tl.sum(skm * mk[:, None], 0)
            tl.debug_barrier()  # every warp has read the slice before it is overwritten
            tl.store(base + s_ptrs, s_c)
            tl.store(base + RP * EP + s_ptrs, s_s)
            tl.store(zb + offs_r, z_c)
            tl.store(zb + RP + offs_r, z_s)
        tl.debug_barrier()
        num += carry[:, None] * inter
        den += carry * inter_d
        esum = esum * decay + tl.sum(vm, 0)
        zsum = zsum * decay + tl.sum(mk, 0)
        c_prev = c_end
        ok = den > 0
        out = tl.where(ok[:, None], num / tl.where(ok, den, 1.0)[:, None], 0.0)
        tl.store(O + ob * sob + oh * soh + offs[:, None] * son + offs_e[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=(offs[:, None] < N) & (offs_e[None, :] < DVA))
        tl.store(CR + pid_g * N + offs, c_row, mask=offs < N)
        tl.store(DEN + pid_g * N + offs, den, mask=offs < N)


@triton.jit
def _row_grad(DO, O, DEN, ob, oh, pid_g, offs, N, DVA, sob, soh, son, sod, EP: tl.constexpr,
              ACC: tl.constexpr):
    """``(g_v, g_d)``: ``g_i = [do_i, −do_i·out_i] / den_i`` split in its value and denominator
    parts (0 for a row with no admissible key)."""
    offs_e = tl.arange(0, EP)
    msk = (offs[:, None] < N) & (offs_e[None, :] < DVA)
    do = tl.load(DO + ob * sob + oh * soh + offs[:, None] * son + offs_e[None, :] * sod, mask=msk, other=0.0)
    out = tl.load(O + ob * sob + oh * soh + offs[:, None] * son + offs_e[None, :] * sod, mask=msk, other=0.0)
    do = do.to(ACC)
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
    pid_g = tl.program_id(0)
    ob = pid_g // H
    oh = pid_g % H
    coef, eps, half_s, p, cap = _load_scalars(SC)
    offs_e = tl.arange(0, EP)
    offs_r = tl.arange(0, RP)
    offs_d = tl.arange(0, D)
    loc = tl.arange(0, CH)
    st = ST + pid_g * (2 * R * 2 * RP * EP)
    zt = ZT + pid_g * (2 * R * 2 * RP)
    s_ptrs = offs_r[:, None] * EP + offs_e[None, :]
    w_ptr = W + ob * swb + oh * swh
    dw_ptr = DW + pid_g * S * R * D
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
        c_end = tl.maximum(c_prev, tl.max(a, 0))
        end_ok = c_end > float("-inf")
        c_end_s = tl.where(end_ok, c_end, 0.0)
        decay = tl.where(end_ok, tl.where(c_prev > float("-inf"), tl.exp(c_prev - c_end_s), 0.0), 0.0)
        mk = tl.where(a > float("-inf"), tl.exp(a - c_end_s), 0.0)
        vm = v * mk[:, None]
        for f in range(0, 2 * R):
            colk = _column(ck, sk, offs_r, f, R)
            base = st + f * (2 * RP * EP)
            s_c = tl.load(base + s_ptrs)
            s_s = tl.load(base + RP * EP + s_ptrs)
            zb = zt + f * (2 * RP)
            z_c = tl.load(zb + offs_r)
            z_s = tl.load(zb + RP + offs_r)
            hc = tl.dot(g, tl.trans(s_c), out_dtype=ACC, input_precision=PREC) + gd[:, None] * z_c[None, :]
            hs = tl.dot(g, tl.trans(s_s), out_dtype=ACC, input_precision=PREC) + gd[:, None] * z_s[None, :]
            col = 2.0 * carry * tl.sum(cq * hc + sq * hs, 1)
            dcq += tl.where((offs_r == f)[None, :], col[:, None], 0.0)
            dsq += tl.where((offs_r == f - R)[None, :], col[:, None], 0.0)
            ckm = ck * colk[:, None]
            skm = sk * colk[:, None]
            s_c = s_c * decay + tl.dot(tl.trans(ckm), vm, out_dtype=ACC, input_precision=PREC)
            s_s = s_s * decay + tl.dot(tl.trans(skm), vm, out_dtype=ACC, input_precision=PREC)
            z_c = z_c * decay + tl.sum(ckm * mk[:, None], 0)
            z_s = z_s * decay + tl.sum(skm * mk[:, None], 0)
            tl.debug_barrier()  # every warp has read the slice before it is overwritten
            tl.store(base + s_ptrs, s_c)
            tl.store(base + RP * EP + s_ptrs, s_s)
            tl.store(zb + offs_r, z_c)
            tl.store(zb + RP + offs_r, z_s)
        tl.debug_barrier()
        c_prev = c_end
        gq = _points_grad(q, dcq, dsq, uq0, uq1, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, dw_ptr, D, S,
                          ACC, PREC)
        rows = pid_g * N + offs
        tl.store(DQ + rows[:, None] * D + offs_d[None, :], gq.to(DQ.dtype.element_ty),
                 mask=(offs[:, None] < N) & (offs_d[None, :] < DA))


@triton.jit
def _bwd_keys_kernel(
    Q, K, V, W, CB, DO, O, CR, DEN, DK, DV_, DCB, DW, ST, ZT, SC, H, N, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    sob, soh, son, sod,
    CH: tl.constexpr, D: tl.constexpr, EP: tl.constexpr, RP: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``dk``, ``dv``, ``dcb`` and the keys' share of ``dW``: a reverse scan with the state ``P``."""
    pid_g = tl.program_id(0)
    ob = pid_g // H
    oh = pid_g % H
    coef, eps, half_s, p, cap = _load_scalars(SC)
    offs_e = tl.arange(0, EP)
    offs_r = tl.arange(0, RP)
    offs_d = tl.arange(0, D)
    loc = tl.arange(0, CH)
    st = ST + pid_g * (2 * R * 2 * RP * EP)
    zt = ZT + pid_g * (2 * R * 2 * RP)
    s_ptrs = offs_r[:, None] * EP + offs_e[None, :]
    w_ptr = W + ob * swb + oh * swh
    dw_ptr = DW + pid_g * S * R * D
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
        c_end = tl.maximum(c_prev, tl.max(a, 0))
        end_ok = c_end > float("-inf")
        c_end_s = tl.where(end_ok, c_end, 0.0)
        m = tl.where(a > float("-inf"), tl.exp(a - c_end_s), 0.0)
        decay = tl.where(end_ok, tl.where(c_prev > float("-inf"), tl.exp(c_prev - c_end_s), 0.0), 0.0)
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
            colq = _column(cq, sq, offs_r, f, R)
            colk = _column(ck, sk, offs_r, f, R)
            base = st + f * (2 * RP * EP)
            p_c = tl.load(base + s_ptrs)
            p_s = tl.load(base + RP * EP + s_ptrs)
            zb = zt + f * (2 * RP)
            pz_c = tl.load(zb + offs_r)
            pz_s = tl.load(zb + RP + offs_r)
            y = tl.dot(ck, p_c, out_dtype=ACC, input_precision=PREC) + tl.dot(sk, p_s, out_dtype=ACC,
                                                                              input_precision=PREC)
            yv = tl.sum(y * v, 1) + tl.sum(ck * pz_c[None, :] + sk * pz_s[None, :], 1)
            dv += (m * colk)[:, None] * y
            da += m * colk * yv
            col = 2.0 * m * yv
            dck += tl.where((offs_r == f)[None, :], col[:, None], 0.0)
            dsk += tl.where((offs_r == f - R)[None, :], col[:, None], 0.0)
            cqm = cq * colq[:, None]
            sqm = sq * colq[:, None]
            p_c = p_c * decay + tl.dot(tl.trans(cqm), gr, out_dtype=ACC, input_precision=PREC)
            p_s = p_s * decay + tl.dot(tl.trans(sqm), gr, out_dtype=ACC, input_precision=PREC)
            pz_c = pz_c * decay + tl.sum(cqm * grd[:, None], 0)
            pz_s = pz_s * decay + tl.sum(sqm * grd[:, None], 0)
            tl.debug_barrier()  # every warp has read the slice before it is overwritten
            tl.store(base + s_ptrs, p_c)
            tl.store(base + RP * EP + s_ptrs, p_s)
            tl.store(zb + offs_r, pz_c)
            tl.store(zb + RP + offs_r, pz_s)
        tl.debug_barrier()
        pe = pe * decay + tl.sum(gr, 0)
        pe_d = pe_d * decay + tl.sum(grd, 0)
        gk = _points_grad(k, dck, dsk, uk0, uk1, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, dw_ptr, D, S,
                          ACC, PREC)
        if MAG > 0:
            _mag, gm = _magnitude(k.to(ACC), half_s, p, cap, MAG)
            gk += da[:, None] * gm
        rows = pid_g * N + offs
        tl.store(DK + rows[:, None] * D + offs_d[None, :], gk.to(DK.dtype.element_ty),
                 mask=(offs[:, None] < N) & (offs_d[None, :] < DA))
        tl.store(DV_ + rows[:, None] * EP + offs_e[None, :], dv.to(DV_.dtype.element_ty),
                 mask=(offs[:, None] < N) & (offs_e[None, :] < DVA))
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
