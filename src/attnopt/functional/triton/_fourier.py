r"""Fused implicit-kernel attention with random Fourier features in Triton (internal).

implicit-kernel-attention eq. 9, 11–16: for points ``W = [w_1; …; w_S]`` (``S`` sets of ``R``
rows, stationary ``S = 1``, non-stationary ``S = 2``) and ``c`` the kernel's coefficient,

.. math:: \phi(x) = c\,\Big[\sum_s \cos(x w_s^\top),\ \sum_s \sin(x w_s^\top)\Big],\quad
          x_{ij} = \phi(q_i)^\top\phi(k_j),\quad
          t_{ij} = \log(x_{ij}^2 + \varepsilon) + a_j + cb_j + m_{ij},

``out_i = Σ_j softmax_j(t_ij) v_j``, with the L^p key magnitude ``a_j = s‖k_j‖_p²/2`` (``1 ≤ p ≤ 2``,
computed from the key tile in the kernel; other ``p`` arrive in the column bias ``cb``), ``cb`` the
key mask (``-inf`` = excluded), ``m`` an additive mask read through its strides, ``CAUSAL`` SDPA's
top-left rule. Flash-style online softmax: the features of a query block are made once per
program, those of each key tile when it is read; nothing of size ``N × 2R`` or ``Nq × Nk`` is
written. A row with no admissible key gets ``ℓ = -inf``, output 0 and zero gradients.

Backward (two kernels, keys then queries, ``P`` recomputed from the saved row log-sum-exp):
``dt = P(do·v − Δ)``, ``dx = dt·2x/(x² + ε)``, ``dφ(q) = dx φ(k)``, ``dφ(k) = dxᵀ φ(q)``,
``da_j = dcb_j = Σ_i dt_ij``, ``dv = Pᵀ do``; then through the features
``du_s = c(−sin(u_s)⊙dφ_cos + cos(u_s)⊙dφ_sin)`` (``u_s = x w_sᵀ``): ``dx += Σ_s du_s w_s``,
``dW_s += du_sᵀ x`` (atomic adds over the blocks into a ``(B·H, S·R, d)`` buffer, summed by autograd
over the points' broadcast dimensions), and the magnitude's ``dk_j += da_j·s‖k_j‖_p^{2−p}|k_j|^{p−1}
sign(k_j)``. Both directions are ``torch.library.triton_op`` ops (``attnopt::triton_ika`` and its
backward).
"""
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from attnopt.functional.triton._flash import BLOCKS, _blocks, _meta, _pow2
from attnopt.functional.triton._tiles import (
    _accumulate,
    _finish,
    _load_lse,
    _load_tile,
    _online,
    _program,
    _span,
    _store_rows,
)

__all__ = ["ika_attention", "magnitude_mode"]

_CAP = {torch.float32: torch.finfo(torch.float32).max / 8, torch.float64: torch.finfo(torch.float64).max / 8}


def magnitude_mode(p: float | None) -> int:
    """The kernels' ``MAG`` for ``magnitude_p``: 0 none, 1 ``p = 1``, 2 ``p = 2``, 3 other ``1 < p < 2``;
    -1 where the kernel does not compute it (the caller passes it in the column bias)."""
    if p is None:
        return 0
    if p == 1.0:
        return 1
    if p == 2.0:
        return 2
    return 3 if 1.0 < p < 2.0 else -1


@triton.jit
def _features(x, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, S: tl.constexpr, ACC: tl.constexpr,
              PREC: tl.constexpr):
    """``(φ_cos, φ_sin, u_0, u_1)`` of a tile ``x (BLOCK, D)`` in the accumulator dtype (the phases
    ``u = x wᵀ`` from the points in the potential dtype); padded points (``r >= R``) give 0."""
    live = offs_r < R
    wm = live[:, None] & (offs_d[None, :] < DA)
    w0 = tl.load(w_ptr + offs_r[:, None] * swr + offs_d[None, :] * swd, mask=wm, other=0.0)
    xa = x.to(ACC)
    u0 = tl.dot(xa, tl.trans(w0.to(ACC)), out_dtype=ACC, input_precision=PREC)
    fc = tl.where(live[None, :], tl.cos(u0), 0.0)
    fs = tl.where(live[None, :], tl.sin(u0), 0.0)
    u1 = u0
    if S == 2:
        w1 = tl.load(w_ptr + (offs_r[:, None] + R) * swr + offs_d[None, :] * swd, mask=wm, other=0.0)
        u1 = tl.dot(xa, tl.trans(w1.to(ACC)), out_dtype=ACC, input_precision=PREC)
        fc += tl.where(live[None, :], tl.cos(u1), 0.0)
        fs += tl.where(live[None, :], tl.sin(u1), 0.0)
    return fc * coef, fs * coef, u0, u1


@triton.jit
def _magnitude(x, half_s, p, cap, MAG: tl.constexpr):
    """``(a, g)``: ``a = s‖x‖_p²/2`` per row (capped at ``cap``) and ``g = ∂a/∂x`` (0 where capped)."""
    ax = tl.abs(x)
    sg = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    if MAG == 1:
        t = tl.sum(ax, 1)
        a = half_s * t * t
        g = (2.0 * half_s) * t[:, None] * sg
    elif MAG == 2:
        t = tl.sum(x * x, 1)
        a = half_s * t
        g = (2.0 * half_s) * x
    else:
        pos = ax > 0
        lax = tl.log(tl.where(pos, ax, 1.0))
        t = tl.sum(tl.where(pos, tl.exp(p * lax), 0.0), 1)
        tp = t > 0
        lt = tl.log(tl.where(tp, t, 1.0))
        a = half_s * tl.where(tp, tl.exp((2.0 / p) * lt), 0.0)
        tg = tl.where(tp, tl.exp((2.0 / p - 1.0) * lt), 0.0)
        g = (2.0 * half_s) * tg[:, None] * tl.where(pos, tl.exp((p - 1.0) * lax), 0.0) * sg
    ok = a < cap
    return tl.where(ok, a, cap), tl.where(ok[:, None], g, 0.0)


@triton.jit
def _side(X, ob, oh, sb, sh, sn, sd, offs, N, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, S: tl.constexpr,
          ACC: tl.constexpr, PREC: tl.constexpr):
    """A query or key tile of ``X[ob, oh]`` at rows ``offs`` (0 past ``N``) and its features:
    ``(x, φ_cos(x), φ_sin(x), u_0, u_1)`` (:func:`_features`)."""
    x = _load_tile(X, ob, oh, sb, sh, sn, sd, offs, N, offs_d, DA)
    fc, fs, u0, u1 = _features(x, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, S, ACC, PREC)
    return x, fc, fs, u0, u1


@triton.jit
def _key_side(K, ob, oh, skb, skh, skn, skd, offs_n, NK, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef,
              cb_ptrs, half_s, p, cap, MAG: tl.constexpr, S: tl.constexpr, ACC: tl.constexpr,
              PREC: tl.constexpr):
    """A key tile: ``(k, φ_cos(k), φ_sin(k), u_0, u_1, cb + a)`` (the column bias with the magnitude)."""
    k, ck, sk, u0, u1 = _side(K, ob, oh, skb, skh, skn, skd, offs_n, NK, w_ptr, swr, swd, offs_r, offs_d, R,
                              DA, coef, S, ACC, PREC)
    cb = tl.load(cb_ptrs, mask=offs_n < NK, other=float("-inf")).to(ACC)
    if MAG > 0:
        a, _g = _magnitude(k.to(ACC), half_s, p, cap, MAG)
        cb = cb + a
    return k, ck, sk, u0, u1, cb


@triton.jit
def _score(cq, sq, ck, sk, cb, m_ptrs, offs_m, offs_n, NQ, NK, eps, dt: tl.constexpr, CAUSAL: tl.constexpr,
           HAS_MASK: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """``(t, x)`` of a (BLOCK_M, BLOCK_N) tile (``t = -inf`` outside the admissible set); the
    feature products in ``dt`` (the input dtype)."""
    x = tl.dot(cq.to(dt), tl.trans(ck.to(dt)), out_dtype=ACC, input_precision=PREC)
    x += tl.dot(sq.to(dt), tl.trans(sk.to(dt)), out_dtype=ACC, input_precision=PREC)
    t = tl.log(x * x + eps)
    if HAS_MASK:
        m = tl.load(m_ptrs, mask=(offs_m[:, None] < NQ) & (offs_n[None, :] < NK), other=float("-inf"))
        t = t + m.to(ACC)
    if CAUSAL:
        t = tl.where(offs_n[None, :] <= offs_m[:, None], t, float("-inf"))
    return t + cb[None, :], x


@triton.jit
def _dx(ds, x, eps):
    """``∂/∂x`` of ``log(x² + ε)`` times the score gradient (0 where ``x² + ε = 0``)."""
    den = x * x + eps
    return tl.where(den > 0, ds * 2.0 * x / tl.where(den > 0, den, 1.0), 0.0)


@triton.jit
def _load_scalars(SC):
    """``(c, ε, s/2, p, cap)`` from a small tensor in the potential dtype (float arguments of a
    compiled kernel are float32)."""
    return tl.load(SC), tl.load(SC + 1), tl.load(SC + 2), tl.load(SC + 3), tl.load(SC + 4)


@triton.jit
def _query_block(Q, W, H, NQ, DA, R, coef, sqb, sqh, sqn, sqd, swb, swh, swr, swd, BLOCK_M: tl.constexpr,
                 D: tl.constexpr, RP: tl.constexpr, S: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """A program over one block of queries (grid ``(Nq blocks, B·H)``): ``(pid_m, pid_g, ob, oh,
    offs_m, w_ptr, q, φ_cos(q), φ_sin(q), u_0, u_1)``, its ids, its (batch, head)'s points and its
    query tile with the features."""
    pid_m, pid_g, ob, oh, offs_m = _program(H, BLOCK_M)
    w_ptr = W + ob * swb + oh * swh
    q, cq, sq, u0, u1 = _side(Q, ob, oh, sqb, sqh, sqn, sqd, offs_m, NQ, w_ptr, swr, swd, tl.arange(0, RP),
                              tl.arange(0, D), R, DA, coef, S, ACC, PREC)
    return pid_m, pid_g, ob, oh, offs_m, w_ptr, q, cq, sq, u0, u1


@triton.jit
def _key_tile(K, CB, M, ob, oh, start_n, offs_m, cq, sq, w_ptr, skb, skh, skn, skd, scb, sch, scn, smb, smh,
              smi, smj, swr, swd, NQ, NK, DA, R, coef, eps, half_s, p, cap, dt: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr,
              D: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
              PREC: tl.constexpr):
    """The key tile at ``start_n`` against a block of queries (features ``cq, sq``): ``(offs_n,
    φ_cos(k), φ_sin(k), t, x)`` (:func:`_key_side`, :func:`_score`)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    _k, ck, sk, _u0, _u1, cb = _key_side(
        K, ob, oh, skb, skh, skn, skd, offs_n, NK, w_ptr, swr, swd, tl.arange(0, RP), tl.arange(0, D), R, DA,
        coef, CB + ob * scb + oh * sch + offs_n * scn, half_s, p, cap, MAG, S, ACC, PREC)
    t, x = _score(cq, sq, ck, sk, cb, M + ob * smb + oh * smh + offs_m[:, None] * smi + offs_n[None, :] * smj,
                  offs_m, offs_n, NQ, NK, eps, dt, CAUSAL, HAS_MASK, ACC, PREC)
    return offs_n, ck, sk, t, x


@triton.jit
def _fwd_kernel(
    Q, K, V, W, CB, M, O, L, SC, H, NQ, NK, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    smb, smh, smi, smj, sob, soh, son, sod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    """Output and row log-sum-exp of one block of queries (a loop over the key tiles)."""
    coef, eps, half_s, p, cap = _load_scalars(SC)
    pid_m, pid_g, ob, oh, offs_m, w_ptr, q, cq, sq, _u0, _u1 = _query_block(
        Q, W, H, NQ, DA, R, coef, sqb, sqh, sqn, sqd, swb, swh, swr, swd, BLOCK_M, D, RP, S, ACC, PREC)
    offs_dv = tl.arange(0, DV)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, DV], ACC)
    lo, hi = _span(pid_m, NK, CAUSAL == 1, False, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, ck, sk, t, _x = _key_tile(
            K, CB, M, ob, oh, start_n, offs_m, cq, sq, w_ptr, skb, skh, skn, skd, scb, sch, scn, smb, smh,
            smi, smj, swr, swd, NQ, NK, DA, R, coef, eps, half_s, p, cap, q.dtype, CAUSAL, HAS_MASK, MAG, S,
            D, RP, BLOCK_N, ACC, PREC)
        pt, corr, m_i, l_i = _online(t, m_i, l_i)
        v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NK, offs_dv, DVA)
        acc = _accumulate(acc, corr, pt, v, ACC, PREC)
    _finish(O, L, ob, oh, sob, soh, son, sod, slb, slh, sln, offs_m, NQ, offs_dv, DVA, acc, m_i, l_i, True)


@triton.jit
def _points_grad(x, dc, ds_, u0, u1, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, DW_ptr, D: tl.constexpr,
                 S: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """From ``dφ = (dc, ds_)`` of a tile ``x``: returns ``dx`` and adds ``duᵀ x`` to the points' gradient."""
    live = offs_r < R
    wm = live[:, None] & (offs_d[None, :] < DA)
    du = tl.where(live[None, :], coef * (ds_ * tl.cos(u0) - dc * tl.sin(u0)), 0.0)
    w0 = tl.load(w_ptr + offs_r[:, None] * swr + offs_d[None, :] * swd, mask=wm, other=0.0).to(ACC)
    gx = tl.dot(du, w0, out_dtype=ACC, input_precision=PREC)
    xa = x.to(ACC)
    tl.atomic_add(DW_ptr + offs_r[:, None] * D + offs_d[None, :],
                  tl.dot(tl.trans(du), xa, out_dtype=ACC, input_precision=PREC), mask=wm)
    if S == 2:
        du1 = tl.where(live[None, :], coef * (ds_ * tl.cos(u1) - dc * tl.sin(u1)), 0.0)
        w1 = tl.load(w_ptr + (offs_r[:, None] + R) * swr + offs_d[None, :] * swd, mask=wm, other=0.0).to(ACC)
        gx += tl.dot(du1, w1, out_dtype=ACC, input_precision=PREC)
        tl.atomic_add(DW_ptr + (offs_r[:, None] + R) * D + offs_d[None, :],
                      tl.dot(tl.trans(du1), xa, out_dtype=ACC, input_precision=PREC), mask=wm)
    return gx


@triton.jit
def _input_grad(DX, x, dc, ds_, u0, u1, da, rows, offs, N, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef,
                dw_ptr, half_s, p, cap, MAG: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                ACC: tl.constexpr, PREC: tl.constexpr):
    """Store ``dx`` of a query or key tile ``x`` as rows ``rows`` of ``DX``: the features' gradient
    ``(dc, ds_)`` through :func:`_points_grad` (which adds the points' share at ``dw_ptr``) plus, for
    keys with the in-kernel magnitude (``MAG > 0``), ``da_j ∂a_j/∂k_j``."""
    gx = _points_grad(x, dc, ds_, u0, u1, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef, dw_ptr, D, S, ACC,
                      PREC)
    if MAG > 0:
        _a, g = _magnitude(x.to(ACC), half_s, p, cap, MAG)
        gx += da[:, None] * g
    _store_rows(DX, rows, offs, N, gx, D, DA)


@triton.jit
def _bwd_keys_kernel(
    Q, K, V, W, CB, M, DO, L, DELTA, DK, DV_, DW, DCB, SC, H, NQ, NK, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    """``dk``, ``dv``, ``dcb`` and the keys' share of ``dW`` for one block of keys (a loop over queries)."""
    pid_n, pid_g, ob, oh, offs_n = _program(H, BLOCK_N)
    coef, eps, half_s, p, cap = _load_scalars(SC)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_r = tl.arange(0, RP)
    offs_m0 = tl.arange(0, BLOCK_M)
    w_ptr = W + ob * swb + oh * swh
    m_ptr = M + ob * smb + oh * smh
    k, ck, sk, u0, u1, cb = _key_side(
        K, ob, oh, skb, skh, skn, skd, offs_n, NK, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef,
        CB + ob * scb + oh * sch + offs_n * scn, half_s, p, cap, MAG, S, ACC, PREC)
    v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NK, offs_dv, DVA)
    dck = tl.zeros([BLOCK_N, RP], ACC)
    dsk = tl.zeros([BLOCK_N, RP], ACC)
    dv = tl.zeros([BLOCK_N, DV], ACC)
    da = tl.zeros([BLOCK_N], ACC)
    lo, hi = _span(pid_n, NQ, False, CAUSAL == 1, BLOCK_N, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        q, cq, sq, _q0, _q1 = _side(Q, ob, oh, sqb, sqh, sqn, sqd, offs_m, NQ, w_ptr, swr, swd, offs_r,
                                    offs_d, R, DA, coef, S, ACC, PREC)
        t, x = _score(cq, sq, ck, sk, cb, m_ptr + offs_m[:, None] * smi + offs_n[None, :] * smj,
                      offs_m, offs_n, NQ, NK, eps, q.dtype, CAUSAL, HAS_MASK, ACC, PREC)
        pt = tl.exp(t - _load_lse(L, ob, oh, slb, slh, sln, offs_m, NQ, ACC)[:, None])
        delta = tl.load(DELTA + pid_g * NQ + offs_m, mask=offs_m < NQ, other=0.0).to(ACC)
        do = _load_tile(DO, ob, oh, sdob, sdoh, sdon, sdod, offs_m, NQ, offs_dv, DVA)
        dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
        dv += tl.dot(tl.trans(pt.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC)
        dt = pt * (dp - delta[:, None])
        dxt = tl.trans(_dx(dt, x, eps))
        dck += tl.dot(dxt, cq, out_dtype=ACC, input_precision=PREC)
        dsk += tl.dot(dxt, sq, out_dtype=ACC, input_precision=PREC)
        da += tl.sum(dt, 0)
    nb = pid_g * NK + offs_n
    _input_grad(DK, k, dck, dsk, u0, u1, da, nb, offs_n, NK, w_ptr, swr, swd, offs_r, offs_d, R, DA, coef,
                DW + pid_g * S * R * D, half_s, p, cap, MAG, D, S, ACC, PREC)
    tl.store(DCB + nb, da, mask=offs_n < NK)
    _store_rows(DV_, nb, offs_n, NK, dv, DV, DVA)


@triton.jit
def _bwd_queries_kernel(
    Q, K, V, W, CB, M, DO, L, DELTA, DQ, DW, SC, H, NQ, NK, DA, DVA, R,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MAG: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    """``dq`` and the queries' share of ``dW`` for one block of queries (a loop over keys)."""
    coef, eps, half_s, p, cap = _load_scalars(SC)
    pid_m, pid_g, ob, oh, offs_m, w_ptr, q, cq, sq, uq0, uq1 = _query_block(
        Q, W, H, NQ, DA, R, coef, sqb, sqh, sqn, sqd, swb, swh, swr, swd, BLOCK_M, D, RP, S, ACC, PREC)
    offs_dv = tl.arange(0, DV)
    lse = _load_lse(L, ob, oh, slb, slh, sln, offs_m, NQ, ACC)
    delta = tl.load(DELTA + pid_g * NQ + offs_m, mask=offs_m < NQ, other=0.0).to(ACC)
    do = _load_tile(DO, ob, oh, sdob, sdoh, sdon, sdod, offs_m, NQ, offs_dv, DVA)
    dcq = tl.zeros([BLOCK_M, RP], ACC)
    dsq = tl.zeros([BLOCK_M, RP], ACC)
    lo, hi = _span(pid_m, NK, CAUSAL == 1, False, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, ck, sk, t, x = _key_tile(
            K, CB, M, ob, oh, start_n, offs_m, cq, sq, w_ptr, skb, skh, skn, skd, scb, sch, scn, smb, smh,
            smi, smj, swr, swd, NQ, NK, DA, R, coef, eps, half_s, p, cap, q.dtype, CAUSAL, HAS_MASK, MAG, S,
            D, RP, BLOCK_N, ACC, PREC)
        pt = tl.exp(t - lse[:, None])
        v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NK, offs_dv, DVA)
        dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
        dx = _dx(pt * (dp - delta[:, None]), x, eps)
        dcq += tl.dot(dx, ck, out_dtype=ACC, input_precision=PREC)
        dsq += tl.dot(dx, sk, out_dtype=ACC, input_precision=PREC)
    # MAG = 0: no magnitude term for queries (its ``da`` argument is then unused)
    _input_grad(DQ, q, dcq, dsq, uq0, uq1, dcq, pid_g * NQ + offs_m, offs_m, NQ, w_ptr, swr, swd,
                tl.arange(0, RP), tl.arange(0, D), R, DA, coef, DW + pid_g * S * R * D, half_s, p, cap, 0, D,
                S, ACC, PREC)


def _common(q: Tensor, v: Tensor, w: Tensor, sets: int) -> tuple[int, int, int, dict[str, Any]]:
    """``(block_m, block_n, R, constexprs)`` shared by the launches."""
    acc, prec = _meta(q)
    bm, bn, warps, stages = _blocks(q.shape[3], q.dtype)
    r = w.shape[2] // sets
    if _pow2(r) >= 64 and BLOCKS[0] is None:  # two (BLOCK_M, RP) feature tiles live in registers: keep them
        bm, warps = min(bm, 64), min(warps, 4)  # at the size R = 32 has with BLOCK_M = 128 (an untuned guess)
    meta = dict(S=sets, D=_pow2(q.shape[3]), DV=_pow2(v.shape[3]), RP=_pow2(r), BLOCK_M=bm, BLOCK_N=bn,
                ACC=acc, PREC=prec, num_warps=warps, num_stages=stages)
    return bm, bn, r, meta


def _scalars(pot: torch.dtype, device: torch.device, coef: float, eps: float, scale: float,
             p: float) -> Tensor:
    """The kernels' scalars ``(c, ε, s/2, p, cap)`` as a tensor in the potential dtype."""
    return torch.tensor([coef, eps, 0.5 * scale, p, _CAP[pot]], dtype=pot, device=device)


@triton_op("attnopt::triton_ika", mutates_args=())
def _ika_fwd(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, mask: Tensor | None, causal: int, mag: int,
    p: float, scale: float, eps: float, coef: float, sets: int,
) -> tuple[Tensor, Tensor]:
    batch, heads, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    bm, _bn, r, meta = _common(q, v, w, sets)
    lse = torch.empty((batch, heads, nq), dtype=cb.dtype, device=q.device)
    out = q.new_empty((batch, heads, nq, dv))
    mm = cb if mask is None else mask
    ms = (0, 0, 0, 0) if mask is None else tuple(mask.stride())
    wrap_triton(_fwd_kernel)[(triton.cdiv(nq, bm), batch * heads)](
        q, k, v, w, cb, mm, out, lse, _scalars(cb.dtype, q.device, coef, eps, scale, p), heads, nq, nk, d, dv,
        r,
        *q.stride(), *k.stride(), *v.stride(), *w.stride(), *cb.stride(), *ms, *out.stride(), *lse.stride(),
        CAUSAL=causal, HAS_MASK=mask is not None, MAG=mag, **meta)
    return out, lse


@triton_op("attnopt::triton_ika_backward", mutates_args=())
def _ika_bwd(
    dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, mask: Tensor | None,
    out: Tensor, lse: Tensor, causal: int, mag: int, p: float, scale: float, eps: float, coef: float,
    sets: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    batch, heads, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    pot = lse.dtype
    delta = ((dout.to(pot) * out.to(pot)).sum(-1) - dlse.to(pot)).contiguous()
    bm, bn, r, meta = _common(q, v, w, sets)
    d_pad, dv_pad = meta["D"], meta["DV"]
    gq = torch.empty((batch, heads, nq, d_pad), dtype=q.dtype, device=q.device)
    gk = torch.empty((batch, heads, nk, d_pad), dtype=q.dtype, device=q.device)
    gv = torch.empty((batch, heads, nk, dv_pad), dtype=q.dtype, device=q.device)
    gw = torch.zeros((batch, heads, sets * r, d_pad), dtype=pot, device=q.device)
    gcb = torch.empty((batch, heads, nk), dtype=pot, device=q.device)
    mm = cb if mask is None else mask
    ms = (0, 0, 0, 0) if mask is None else tuple(mask.stride())
    do = dout.to(q.dtype)
    args = (_scalars(pot, q.device, coef, eps, scale, p), heads, nq, nk, d, dv, r)
    strides = (*q.stride(), *k.stride(), *v.stride(), *w.stride(), *cb.stride(), *ms, *do.stride(),
               *lse.stride())
    flags = dict(CAUSAL=causal, HAS_MASK=mask is not None, MAG=mag, **meta)
    wrap_triton(_bwd_keys_kernel)[(triton.cdiv(nk, bn), batch * heads)](
        q, k, v, w, cb, mm, do, lse, delta, gk, gv, gw, gcb, *args, *strides, **flags)
    wrap_triton(_bwd_queries_kernel)[(triton.cdiv(nq, bm), batch * heads)](
        q, k, v, w, cb, mm, do, lse, delta, gq, gw, *args, *strides, **flags)
    return gq[..., :d], gk[..., :d], gv[..., :dv], gw[..., :d].to(w.dtype), gcb


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, w, cb, mask, *rest = inputs
    ctx.rest = rest
    ctx.save_for_backward(q, k, v, w, cb, mask, *output)


def _backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, w, cb, mask, out, lse = ctx.saved_tensors
    gq, gk, gv, gw, gcb = _ika_bwd(dout, dlse, q, k, v, w, cb, mask, out, lse, *ctx.rest)
    return (gq, gk, gv, gw, gcb) + (None,) * 8


_ika_fwd.register_autograd(_backward, setup_context=_setup)


def ika_attention(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, cb: Tensor, mask: Tensor | None, *, causal: bool,
    magnitude_p: float | None, scale: float, eps: float, coef: float, sets: int,
) -> tuple[Tensor, Tensor]:
    """``(out, ℓ)`` of the module docstring.

    Args:
        q: (B, H, Nq, d). k: (B, H, Nk, d). v: (B, H, Nk, dv), all in one dtype.
        w: (B, H, S·R, d) points in ``q``'s dtype (stride 0 where they broadcast); set ``s`` = rows
            ``[sR, (s+1)R)``.
        cb: (B, H, Nk) column bias in the potential dtype (key mask, and the magnitude where
            :func:`magnitude_mode` is -1), ``-inf`` = excluded; differentiable.
        mask: additive (B, H, Nq, Nk) view (any strides) or None.
        causal: SDPA's top-left causal rule.
        magnitude_p: ``p`` of the in-kernel magnitude (``magnitude_mode(p) >= 0``), None = none.
        scale: ``s`` of the magnitude. eps: ``ε``. coef: ``c``. sets: ``S`` (1 or 2).
    Returns:
        ``out (B, H, Nq, dv)`` in ``q``'s dtype, ``ℓ (B, H, Nq)`` in ``cb``'s dtype.
    """
    mag = magnitude_mode(magnitude_p)
    if mag < 0:
        raise ValueError(f"the fused kernel computes magnitude_p in [1, 2] or None, got {magnitude_p}")
    p = 2.0 if magnitude_p is None else float(magnitude_p)
    return _ika_fwd(q, k, v, w, cb, mask, int(causal), mag, p, float(scale), float(eps), float(coef),
                    int(sets))
