r"""Sparsemax / α-entmax attention as Triton kernels (sdpa-one-sided-eot Prop. 4.2–4.3).

Each row's weights are ``p_ij = [z_ij − τ_i]₊^{a} / Z_i`` with ``z = (α − 1) s``, ``a = 1/(α − 1)``,
scores ``s_ij = scale <q_i, k_j> + m_ij`` and ``τ_i`` the root of ``f(τ) = Σ_j [z_ij − τ]₊^a − 1``
(``Z_i = Σ_j p`` before normalization, 1 up to the solver's tolerance; as the reference, which
renormalizes too). Per row block, without ever holding a row of scores:

1. one pass over the key blocks: the row maximum ``M`` and the admissible-key count ``n``;
   the root lies in ``[M − 1, M − n^{1−α}]`` (``f ≥ 0`` at the left end, ``≤ 0`` at the right);
2. safeguarded Newton steps, each one pass over the key blocks for ``f`` and ``f'``, keeping the
   bracket and bisecting when a step leaves it, until every row's ``|f| ≤ tol`` (1e-6 in float32,
   1e-12 in float64) or 50 steps (sparsemax: Newton from the left is exact once the support is
   found; for α ≤ 2, ``f`` is convex and decreasing, so Newton from the left end is monotone and
   converges superlinearly, and the bracket keeps α > 2 safe). No host sync checks convergence
   (the GPU path never waits on the device); the rows are renormalized by their sum ``Z``;
3. the output pass ``o_i = Σ_j p_ij v_j`` and ``u_i = Σ_j g_ij v_j / Σ_j g_ij`` with
   ``g = p^{2−α} ∝ [z − τ]₊^{a−1}`` (the support weights), kept for the backward.

Backward (Jacobian ``diag(g) − g gᵀ/Σg`` of the map, Peters et al. 2019): with
``δ_i = do_i · u_i``, ``dS_ij = g_ij (do_i·v_j − δ_i)``, ``dq = scale dS k``,
``dk = scale dSᵀ q``, ``dv = pᵀ do``; two kernels (key blocks, then query blocks) recompute
``p`` from ``τ`` and ``Z`` and skip every tile whose weights are all zero. Memory: O(N) per head
(``τ``, ``Z``, ``u``). α > 1 (sparse maps); sparsemax (α = 2) and 1.5-entmax have pow-free
specializations. Fully masked rows give zeros and zero gradients.

Why not route to the ``adasplash`` package (AdaSplash, Triton, α ∈ (1, 2]) where it covers a
call: its calls are not ``torch.library`` ops (``torch.compile`` / ``export`` would trace into or
break on them), it takes no ``scale`` and no mask beyond causal / per-sequence lengths, it solves
the threshold to a fixed iteration count (AdaSplash-2 defaults to one refinement step) rather than
to a tolerance, and whether it is at least as fast here is a GPU measurement not yet made. It is
therefore a peer in ``attnopt bench --device cuda`` (``scripts/gpu_check.sh``), where the rows
decide: if it wins on its domain, routing those calls to it is a one-line change in
``regularized_attention``'s hook. Installing it is never required.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from attnopt.functional.triton import check_device
from attnopt.functional.triton._flash import INTERPRETED, _blocks, _meta, _pow2, _scores
from attnopt.functional.triton._shapes import prepare

__all__ = ["sparse_attention"]

_MAX_ITER = 50


@triton.jit
def _powers(d, a, KIND: tl.constexpr):
    """``(d^a, d^(a−1))`` for ``d >= 0`` (0 where ``d = 0``); KIND 0: a = 1, 1: a = 2, 2: any a."""
    pos = d > 0
    if KIND == 0:
        p = d
        w = tl.where(pos, 1.0, 0.0).to(d.dtype)
    elif KIND == 1:
        p = d * d
        w = d
    else:
        ld = tl.log(tl.where(pos, d, 1.0))
        p = tl.where(pos, tl.exp(a * ld), 0.0)
        w = tl.where(pos, tl.exp((a - 1.0) * ld), 0.0)
    return p, w


@triton.jit
def _fwd_kernel(
    A, B, V, CB, M, O, TAU, ZN, U, scale, am1, a, tol, max_iter, H, NA, NB, DA, DVA,
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sob, soh, son, sod,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, KIND: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    ob = pid_g // H
    oh = pid_g % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    a_blk = tl.load(A + ob * sab + oh * sah + offs_m[:, None] * san + offs_d[None, :] * sad,
                    mask=(offs_m[:, None] < NA) & (offs_d[None, :] < DA), other=0.0)
    B0 = B + ob * sbb + oh * sbh
    C0 = CB + ob * scb + oh * sch
    M0 = M + ob * smb + oh * smh
    lo_n = 0
    hi_n = NB
    if CAUSAL == 1:
        hi_n = tl.minimum(NB, (pid_m + 1) * BLOCK_M)
    # 1. row maximum and admissible-key count
    mx = tl.full([BLOCK_M], float("-inf"), ACC)
    cnt = tl.zeros([BLOCK_M], ACC)
    for start_n in range(lo_n, hi_n, BLOCK_N):
        offs_n = start_n + offs_n0
        s, _b = _scores(a_blk, B0 + offs_n[:, None] * sbn + offs_d[None, :] * sbd, C0 + offs_n * scn,
                        M0 + offs_m[:, None] * smi + offs_n[None, :] * smj, offs_m, offs_n, NA, NB, DA,
                        scale, offs_d, CAUSAL, HAS_MASK, ACC, PREC)
        mx = tl.maximum(mx, tl.max(s, 1))
        cnt += tl.sum(tl.where(s > float("-inf"), 1.0, 0.0), 1)
    some = cnt > 0
    zmax = tl.where(some, am1 * mx, 0.0)
    lo = zmax - 1.0
    hi = zmax - tl.exp(-am1 * tl.log(tl.maximum(cnt, 1.0)))  # M - n^(1 - alpha)
    tau = lo
    # 2. safeguarded Newton on f(tau) = sum_j [z_ij - tau]_+^a - 1
    done = (~some) | (offs_m >= NA)
    it = tl.full([], 0, tl.int32)
    while (it < max_iter) & (tl.min(done.to(tl.int32), 0) == 0):
        f = tl.zeros([BLOCK_M], ACC) - 1.0
        df = tl.zeros([BLOCK_M], ACC)
        for start_n in range(lo_n, hi_n, BLOCK_N):
            offs_n = start_n + offs_n0
            s, _b = _scores(a_blk, B0 + offs_n[:, None] * sbn + offs_d[None, :] * sbd, C0 + offs_n * scn,
                            M0 + offs_m[:, None] * smi + offs_n[None, :] * smj, offs_m, offs_n, NA, NB, DA,
                            scale, offs_d, CAUSAL, HAS_MASK, ACC, PREC)
            d = tl.maximum(am1 * s - tau[:, None], 0.0)
            p, w = _powers(d, a, KIND)
            f += tl.sum(p, 1)
            df += tl.sum(w, 1)
        conv = tl.abs(f) <= tol
        lo = tl.where(f >= 0, tau, lo)
        hi = tl.where(f < 0, tau, hi)
        step = tau + f / tl.where(df > 0, a * df, 1.0)
        ok = (df > 0) & (step > lo) & (step < hi)
        nxt = tl.where(ok, step, 0.5 * (lo + hi))
        tau = tl.where(done | conv, tau, nxt)
        done = done | conv
        it += 1
    # 3. output pass: o = sum p v / Z, u = sum g v / sum g
    acc = tl.zeros([BLOCK_M, DV], ACC)
    accg = tl.zeros([BLOCK_M, DV], ACC)
    z = tl.zeros([BLOCK_M], ACC)
    gs = tl.zeros([BLOCK_M], ACC)
    for start_n in range(lo_n, hi_n, BLOCK_N):
        offs_n = start_n + offs_n0
        s, _b = _scores(a_blk, B0 + offs_n[:, None] * sbn + offs_d[None, :] * sbd, C0 + offs_n * scn,
                        M0 + offs_m[:, None] * smi + offs_n[None, :] * smj, offs_m, offs_n, NA, NB, DA,
                        scale, offs_d, CAUSAL, HAS_MASK, ACC, PREC)
        d = tl.where(some[:, None], tl.maximum(am1 * s - tau[:, None], 0.0), 0.0)
        p, w = _powers(d, a, KIND)
        if tl.max(tl.max(p, 1), 0) > 0:  # skip an all-zero tile
            v = tl.load(V + ob * svb + oh * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=(offs_n[:, None] < NB) & (offs_dv[None, :] < DVA), other=0.0)
            acc += tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=PREC)
            accg += tl.dot(w.to(v.dtype), v, out_dtype=ACC, input_precision=PREC)
            z += tl.sum(p, 1)
            gs += tl.sum(w, 1)
    out = acc / tl.where(z > 0, z, 1.0)[:, None]
    u = accg / tl.where(gs > 0, gs, 1.0)[:, None]
    rows = pid_g * NA + offs_m
    omask = (offs_m[:, None] < NA) & (offs_dv[None, :] < DVA)
    tl.store(O + ob * sob + oh * soh + offs_m[:, None] * son + offs_dv[None, :] * sod,
             out.to(O.dtype.element_ty), mask=omask)
    tl.store(U + rows[:, None] * DV + offs_dv[None, :], u, mask=omask)
    tl.store(TAU + rows, tl.where(some, tau, float("inf")), mask=offs_m < NA)
    tl.store(ZN + rows, tl.where(z > 0, z, 1.0), mask=offs_m < NA)


@triton.jit
def _tile(a_blk, b_ptrs, c_ptrs, m_ptrs, offs_m, offs_n, NA, NB, DA, scale, offs_d, tau, zn, am1, a,
          CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, KIND: tl.constexpr, ACC: tl.constexpr,
          PREC: tl.constexpr):
    """``(p, g, b, nonzero)`` of one tile: weights, support weights, keys, whether any ``p > 0``."""
    s, b = _scores(a_blk, b_ptrs, c_ptrs, m_ptrs, offs_m, offs_n, NA, NB, DA, scale, offs_d, CAUSAL,
                   HAS_MASK, ACC, PREC)
    d = tl.maximum(am1 * s - tau[:, None], 0.0)
    p, w = _powers(d, a, KIND)
    p = p / zn[:, None]
    return p, w, b, tl.max(tl.max(p, 1), 0) > 0


@triton.jit
def _bwd_cols_kernel(
    A, B, V, CB, M, DO, TAU, ZN, DELTA, DB, DV_, scale, am1, a, H, NA, NB, DA, DVA,
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, KIND: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    ob = pid_g // H
    oh = pid_g % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_m0 = tl.arange(0, BLOCK_M)
    v = tl.load(V + ob * svb + oh * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=(offs_n[:, None] < NB) & (offs_dv[None, :] < DVA), other=0.0)
    db = tl.zeros([BLOCK_N, D], ACC)
    dv = tl.zeros([BLOCK_N, DV], ACC)
    lo = 0
    if CAUSAL == 1:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, NA, BLOCK_M):
        offs_m = start_m + offs_m0
        rows = pid_g * NA + offs_m
        a_blk = tl.load(A + ob * sab + oh * sah + offs_m[:, None] * san + offs_d[None, :] * sad,
                        mask=(offs_m[:, None] < NA) & (offs_d[None, :] < DA), other=0.0)
        tau = tl.load(TAU + rows, mask=offs_m < NA, other=float("inf")).to(ACC)
        zn = tl.load(ZN + rows, mask=offs_m < NA, other=1.0).to(ACC)
        delta = tl.load(DELTA + rows, mask=offs_m < NA, other=0.0).to(ACC)
        do = tl.load(DO + ob * sdob + oh * sdoh + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                     mask=(offs_m[:, None] < NA) & (offs_dv[None, :] < DVA), other=0.0)
        p, w, _b, nz = _tile(
            a_blk, B + ob * sbb + oh * sbh + offs_n[:, None] * sbn + offs_d[None, :] * sbd,
            CB + ob * scb + oh * sch + offs_n * scn,
            M + ob * smb + oh * smh + offs_m[:, None] * smi + offs_n[None, :] * smj,
            offs_m, offs_n, NA, NB, DA, scale, offs_d, tau, zn, am1, a, CAUSAL, HAS_MASK, KIND, ACC, PREC)
        if nz:  # skip an all-zero tile
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
            ds = w * (dp - delta[:, None])
            db += tl.dot(tl.trans(ds.to(a_blk.dtype)), a_blk, out_dtype=ACC, input_precision=PREC)
    nb = pid_g * NB + offs_n
    tl.store(DB + nb[:, None] * D + offs_d[None, :], (db * scale).to(DB.dtype.element_ty),
             mask=(offs_n[:, None] < NB) & (offs_d[None, :] < DA))
    tl.store(DV_ + nb[:, None] * DV + offs_dv[None, :], dv.to(DV_.dtype.element_ty),
             mask=(offs_n[:, None] < NB) & (offs_dv[None, :] < DVA))


@triton.jit
def _bwd_rows_kernel(
    A, B, V, CB, M, DO, TAU, ZN, DELTA, DA_, scale, am1, a, H, NA, NB, DA, DVA,
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, KIND: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    ob = pid_g // H
    oh = pid_g % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    rows = pid_g * NA + offs_m
    a_blk = tl.load(A + ob * sab + oh * sah + offs_m[:, None] * san + offs_d[None, :] * sad,
                    mask=(offs_m[:, None] < NA) & (offs_d[None, :] < DA), other=0.0)
    tau = tl.load(TAU + rows, mask=offs_m < NA, other=float("inf")).to(ACC)
    zn = tl.load(ZN + rows, mask=offs_m < NA, other=1.0).to(ACC)
    delta = tl.load(DELTA + rows, mask=offs_m < NA, other=0.0).to(ACC)
    do = tl.load(DO + ob * sdob + oh * sdoh + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                 mask=(offs_m[:, None] < NA) & (offs_dv[None, :] < DVA), other=0.0)
    da = tl.zeros([BLOCK_M, D], ACC)
    hi = NB
    if CAUSAL == 1:
        hi = tl.minimum(NB, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        v = tl.load(V + ob * svb + oh * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < NB) & (offs_dv[None, :] < DVA), other=0.0)
        _p, w, b, nz = _tile(
            a_blk, B + ob * sbb + oh * sbh + offs_n[:, None] * sbn + offs_d[None, :] * sbd,
            CB + ob * scb + oh * sch + offs_n * scn,
            M + ob * smb + oh * smh + offs_m[:, None] * smi + offs_n[None, :] * smj,
            offs_m, offs_n, NA, NB, DA, scale, offs_d, tau, zn, am1, a, CAUSAL, HAS_MASK, KIND, ACC, PREC)
        if nz:  # skip an all-zero tile
            dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
            ds = w * (dp - delta[:, None])
            da += tl.dot(ds.to(b.dtype), b, out_dtype=ACC, input_precision=PREC)
    tl.store(DA_ + rows[:, None] * D + offs_d[None, :], (da * scale).to(DA_.dtype.element_ty),
             mask=(offs_m[:, None] < NA) & (offs_d[None, :] < DA))


def _kind(alpha: float) -> int:
    return 0 if alpha == 2.0 else 1 if alpha == 1.5 else 2


def _mask_args(mask: Tensor | None, cb: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    return (cb, (0, 0, 0, 0)) if mask is None else (mask, tuple(mask.stride()))


@triton_op("attnopt::triton_entmax_attention", mutates_args=())
def _sparse_fwd(
    q: Tensor, k: Tensor, v: Tensor, cb: Tensor, mask: Tensor | None, alpha: float, causal: int, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch, heads, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    acc, prec = _meta(q)
    pot = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty((batch, heads, nq, dv))
    tau = torch.empty((batch, heads, nq), dtype=pot, device=q.device)
    zn = torch.empty((batch, heads, nq), dtype=pot, device=q.device)
    u = torch.empty((batch, heads, nq, _pow2(dv)), dtype=pot, device=q.device)
    bm, bn, warps, stages = _blocks(d, q.dtype)
    mm, ms = _mask_args(mask, cb)
    tol = 1e-12 if q.dtype == torch.float64 else 1e-6
    wrap_triton(_fwd_kernel)[(triton.cdiv(nq, bm), batch * heads)](
        q, k, v, cb, mm, out, tau, zn, u, scale, alpha - 1.0, 1.0 / (alpha - 1.0), tol, _MAX_ITER,
        heads, nq, nk, d, dv, *q.stride(), *k.stride(), *v.stride(), *cb.stride(), *ms, *out.stride(),
        CAUSAL=causal, HAS_MASK=mask is not None, KIND=_kind(alpha), D=_pow2(d), DV=_pow2(dv), BLOCK_M=bm,
        BLOCK_N=bn, ACC=acc, PREC=prec, num_warps=warps, num_stages=stages,
    )
    return out, tau, zn, u[..., :dv]


@triton_op("attnopt::triton_entmax_attention_backward", mutates_args=())
def _sparse_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cb: Tensor, mask: Tensor | None, tau: Tensor, zn: Tensor,
    u: Tensor, alpha: float, causal: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    batch, heads, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    acc, prec = _meta(q)
    delta = (dout.to(u.dtype) * u).sum(-1).contiguous()
    dq = torch.empty((batch, heads, nq, _pow2(d)), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, heads, nk, _pow2(d)), dtype=q.dtype, device=q.device)
    dvv = torch.empty((batch, heads, nk, _pow2(dv)), dtype=q.dtype, device=q.device)
    bm, bn, warps, stages = _blocks(d, q.dtype)
    mm, ms = _mask_args(mask, cb)
    dout = dout.to(q.dtype)
    common = dict(CAUSAL=causal, HAS_MASK=mask is not None, KIND=_kind(alpha), D=_pow2(d), DV=_pow2(dv),
                  BLOCK_M=bm, BLOCK_N=bn, ACC=acc, PREC=prec, num_warps=warps, num_stages=stages)
    strides = (*q.stride(), *k.stride(), *v.stride(), *cb.stride(), *ms, *dout.stride())
    args = (scale, alpha - 1.0, 1.0 / (alpha - 1.0), heads, nq, nk, d, dv)
    wrap_triton(_bwd_cols_kernel)[(triton.cdiv(nk, bn), batch * heads)](
        q, k, v, cb, mm, dout, tau, zn, delta, dk, dvv, *args, *strides, **common)
    wrap_triton(_bwd_rows_kernel)[(triton.cdiv(nq, bm), batch * heads)](
        q, k, v, cb, mm, dout, tau, zn, delta, dq, *args, *strides, **common)
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, cb, mask, alpha, causal, scale = inputs
    _, tau, zn, u = output
    ctx.alpha, ctx.causal, ctx.scale = alpha, causal, scale
    ctx.save_for_backward(q, k, v, cb, mask, tau, zn, u)


def _backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    q, k, v, cb, mask, tau, zn, u = ctx.saved_tensors
    dq, dk, dv = _sparse_bwd(dout, q, k, v, cb, mask, tau, zn, u, ctx.alpha, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_sparse_fwd.register_autograd(_backward, setup_context=_setup)


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, alpha: float, attn_mask: Tensor | None, scale: float, is_causal: bool
) -> Tensor:
    """α-entmax attention (``alpha = 2``: sparsemax) on validated, non-empty inputs.

    Args:
        q, k, v: (…, N, ·) tensors. alpha: > 1. attn_mask: SDPA-style mask or None (not
        differentiated). scale: score scale. is_causal: SDPA's top-left causal mask.
    Returns:
        (…, Nq, dv) in ``q``'s dtype; rows with no admissible key are zeros.
    Raises:
        ValueError: ``alpha <= 1``.
        RuntimeError: the kernels cannot run on this device.
    """
    if not alpha > 1.0:
        raise ValueError(f"the Triton entmax kernels need alpha > 1, got {alpha}")
    check_device(q, INTERPRETED)
    p = prepare(q, k, v, attn_mask)
    assert p.v is not None
    out = _sparse_fwd(p.q, p.k, p.v, p.key_bias, p.mask, float(alpha), 1 if is_causal else 0, scale)[0]
    return p.restore(out)
