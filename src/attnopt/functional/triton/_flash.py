r"""The flash-style Triton primitive every normalization pass is built from (internal).

For rows ``a_i`` and columns ``b_j`` of one (batch, head):

.. math:: t_{ij} = \mathrm{scale}\,\langle a_i, b_j\rangle + cb_j + m_{ij}, \quad
          \ell_i = \log\sum_j e^{t_{ij}}, \quad o_i = \sum_j e^{t_{ij} - \ell_i} v_j

with a column bias ``cb`` (``-inf`` = column excluded), an optional additive mask ``m`` read
through its strides (a transposed or stride-0 expanded view costs nothing) and a causal rule
(``CAUSAL = 1``: ``j <= i``, SDPA's top-left mask; ``2``: ``j >= i``, the same mask seen from
the swapped pass). Without values it is a pure log-sum-exp pass. A row with no admissible
column gets ``ℓ = -inf`` and ``o = 0``, and zero gradients (no NaN).

Backward, with ``dt_ij = P_ij (do_i·v_j − Δ_i)``, ``P = e^{t − ℓ}``, ``Δ_i = do_i·o_i − dℓ_i``
(the log-sum-exp gradient only shifts ``Δ``): ``da = scale dt b``, ``db = scale dtᵀ a``,
``dv = Pᵀ do``, ``dcb_j = Σ_i dt_ij``. Two kernels (columns, then rows) recompute ``P``;
nothing of size ``Na × Nb`` is stored (flash-attention-2, Dao 2023).

DNAS is two calls (design.md §3): the swapped pass ``c_j = ℓ`` over queries, then the attention
pass with ``cb = −c``; autograd through the chain gives exactly ``dk_j += scale·dc_j·O'_j`` and
``dq_i += scale Σ_j dc_j e^{s_ij − c_j} k_j`` (the swapped pass's backward with ``dℓ = dc``).

Both directions are ``torch.library.triton_op`` ops (``attnopt::triton_flash`` and its backward),
so ``torch.compile`` / ``torch.export`` see the kernels. Triton is imported when this module is
imported; import it lazily (``attnopt.functional.triton``). Under ``TRITON_INTERPRET=1`` (read
when the kernels are decorated) they run on CPU tensors; bf16 ``tl.dot`` is wrong in the
interpreter, so CPU tests use fp16/fp32/fp64.
"""
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from attnopt.functional.triton import interpreting
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

__all__ = ["flash", "hnas_attention", "INTERPRETED", "BLOCKS"]

#: whether the kernels below were decorated for Triton's CPU interpreter
INTERPRETED = interpreting()

#: (BLOCK_M, BLOCK_N) override; ``None`` = :func:`_blocks`' choice (tests set small blocks)
BLOCKS: list[tuple[int, int] | None] = [None]


@triton.jit
def _scores_x(a, b_ptrs, cb_ptrs, m_ptrs, offs_m, offs_n, NA, NB, DA, scale, offs_d, eps,
              CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SCORE: tl.constexpr, ACC: tl.constexpr,
              PREC: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile ``(t, b, x, t0)``: scores (-inf outside the admissible set), the
    columns, the raw products ``x = <a_i, b_j>``, the scores without the column bias;
    ``t = scale·x`` (SCORE 0) or ``log(x² + eps)`` (1)."""
    b = tl.load(b_ptrs, mask=(offs_n[:, None] < NB) & (offs_d[None, :] < DA), other=0.0)
    x = tl.dot(a, tl.trans(b), out_dtype=ACC, input_precision=PREC)
    if SCORE == 0:
        s = x * scale
    else:
        s = tl.log(x * x + eps)
    if HAS_MASK:
        m = tl.load(m_ptrs, mask=(offs_m[:, None] < NA) & (offs_n[None, :] < NB), other=float("-inf"))
        s = s + m.to(ACC)
    if CAUSAL == 1:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    if CAUSAL == 2:
        s = tl.where(offs_n[None, :] >= offs_m[:, None], s, float("-inf"))
    cb = tl.load(cb_ptrs, mask=offs_n < NB, other=float("-inf")).to(ACC)
    return s + cb[None, :], b, x, s


@triton.jit
def _scores(a, b_ptrs, cb_ptrs, m_ptrs, offs_m, offs_n, NA, NB, DA, scale, offs_d,
            CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """``(t, b)`` of :func:`_scores_x` for dot-product scores."""
    s, b, _x, _s0 = _scores_x(a, b_ptrs, cb_ptrs, m_ptrs, offs_m, offs_n, NA, NB, DA, scale, offs_d, 0.0,
                         CAUSAL, HAS_MASK, 0, ACC, PREC)
    return s, b


@triton.jit
def _row_tile(a, B, CB, M, ob, oh, offs_m, start_n, offs_d, sbb, sbh, sbn, sbd, scb, sch, scn, smb, smh, smi,
              smj, NA, NB, DA, scale, eps, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SCORE: tl.constexpr,
              BLOCK_N: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """The column tile at ``start_n`` against a block of rows ``a``: ``(offs_n, t, b, x, t0)`` of
    :func:`_scores_x`, reading ``B``, ``CB`` and ``M`` of the (batch, head) ``(ob, oh)``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    t, b, x, t0 = _scores_x(
        a, B + ob * sbb + oh * sbh + offs_n[:, None] * sbn + offs_d[None, :] * sbd,
        CB + ob * scb + oh * sch + offs_n * scn,
        M + ob * smb + oh * smh + offs_m[:, None] * smi + offs_n[None, :] * smj,
        offs_m, offs_n, NA, NB, DA, scale, offs_d, eps, CAUSAL, HAS_MASK, SCORE, ACC, PREC)
    return offs_n, t, b, x, t0


@triton.jit
def _dx(ds, x, eps, SCORE: tl.constexpr):
    """Gradient with respect to the raw products ``x`` from the one with respect to ``t``."""
    if SCORE == 0:
        out = ds
    else:
        den = x * x + eps
        out = tl.where(den > 0, ds * 2.0 * x / tl.where(den > 0, den, 1.0), 0.0)
    return out


@triton.jit
def _fwd_kernel(
    A, B, V, CB, M, O, L, CB2, O2, L2, WG, scale, eps, H, NA, NB, DA, DVA,  # noqa: ARG001 (WG: backward's)
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sob, soh, son, sod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_V: tl.constexpr, HAS_MASK: tl.constexpr, SCORE: tl.constexpr,
    DUAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """Row log-sum-exp and (``HAS_V``) output of one block of rows (a loop over the columns)."""
    pid_m, pid_g, ob, oh, offs_m = _program(H, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    a = _load_tile(A, ob, oh, sab, sah, san, sad, offs_m, NA, offs_d, DA)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, DV], ACC)
    if DUAL:  # the second pass (HNAS's LNAS term): same scores, column bias CB2
        m2 = tl.full([BLOCK_M], float("-inf"), ACC)
        l2 = tl.zeros([BLOCK_M], ACC)
        acc2 = tl.zeros([BLOCK_M, DV], ACC)
    lo, hi = _span(pid_m, NB, CAUSAL == 1, CAUSAL == 2, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, s, _b, _x, s0 = _row_tile(
            a, B, CB, M, ob, oh, offs_m, start_n, offs_d, sbb, sbh, sbn, sbd, scb, sch, scn, smb, smh, smi,
            smj, NA, NB, DA, scale, eps, CAUSAL, HAS_MASK, SCORE, BLOCK_N, ACC, PREC)
        p, corr, m_i, l_i = _online(s, m_i, l_i)
        if HAS_V:
            v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NB, offs_dv, DVA)
            acc = _accumulate(acc, corr, p, v, ACC, PREC)
            if DUAL:
                cb2 = tl.load(CB2 + ob * scb + oh * sch + offs_n * scn, mask=offs_n < NB,
                              other=float("-inf")).to(ACC)
                p2, corr2, m2, l2 = _online(s0 + cb2[None, :], m2, l2)
                acc2 = _accumulate(acc2, corr2, p2, v, ACC, PREC)
    _finish(O, L, ob, oh, sob, soh, son, sod, slb, slh, sln, offs_m, NA, offs_dv, DVA, acc, m_i, l_i, HAS_V)
    if DUAL:
        _finish(O2, L2, ob, oh, sob, soh, son, sod, slb, slh, sln, offs_m, NA, offs_dv, DVA, acc2, m2, l2,
                True)


@triton.jit
def _bwd_cols_kernel(
    A, B, V, CB, M, DO, L, DELTA, CB2, L2, DELTA2, WG, DB, DV_, DCB, scale, eps, H, NA, NB, DA, DVA,
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_V: tl.constexpr, HAS_MASK: tl.constexpr, SCORE: tl.constexpr,
    DUAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``db``, ``dv``, ``dcb`` for one block of columns (a loop over the rows)."""
    pid_n, pid_g, ob, oh, offs_n = _program(H, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_m0 = tl.arange(0, BLOCK_M)
    b_ptrs = B + ob * sbb + oh * sbh + offs_n[:, None] * sbn + offs_d[None, :] * sbd
    v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NB, offs_dv, DVA)
    db = tl.zeros([BLOCK_N, D], ACC)
    dv = tl.zeros([BLOCK_N, DV], ACC)
    dcb = tl.zeros([BLOCK_N], ACC)
    if DUAL:
        wgt = tl.load(WG + pid_g).to(ACC)
        cb2 = tl.load(CB2 + ob * scb + oh * sch + offs_n * scn, mask=offs_n < NB, other=float("-inf")).to(ACC)
    lo, hi = _span(pid_n, NA, CAUSAL == 2, CAUSAL == 1, BLOCK_N, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        a = _load_tile(A, ob, oh, sab, sah, san, sad, offs_m, NA, offs_d, DA)
        s, _b, x, s0 = _scores_x(
            a, b_ptrs, CB + ob * scb + oh * sch + offs_n * scn,
            M + ob * smb + oh * smh + offs_m[:, None] * smi + offs_n[None, :] * smj,
            offs_m, offs_n, NA, NB, DA, scale, offs_d, eps, CAUSAL, HAS_MASK, SCORE, ACC, PREC)
        p = tl.exp(s - _load_lse(L, ob, oh, slb, slh, sln, offs_m, NA, ACC)[:, None])
        delta = tl.load(DELTA + pid_g * NA + offs_m, mask=offs_m < NA, other=0.0).to(ACC)
        if HAS_V:
            do = _load_tile(DO, ob, oh, sdob, sdoh, sdon, sdod, offs_m, NA, offs_dv, DVA)
            dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
            if DUAL:  # out = w o1 + (1 - w) o2: DELTA = w do.o1, DELTA2 = (1 - w) do.o2
                lse2 = _load_lse(L2, ob, oh, slb, slh, sln, offs_m, NA, ACC)
                p2 = tl.exp(s0 + cb2[None, :] - lse2[:, None])
                delta2 = tl.load(DELTA2 + pid_g * NA + offs_m, mask=offs_m < NA, other=0.0).to(ACC)
                pm = wgt * p + (1.0 - wgt) * p2
                dv += tl.dot(tl.trans(pm.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC)
                ds = p * (wgt * dp - delta[:, None])
                dsx = ds + p2 * ((1.0 - wgt) * dp - delta2[:, None])
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC)
                ds = p * (dp - delta[:, None])
                dsx = ds
        else:
            ds = p * (-delta[:, None])
            dsx = ds
        db += tl.dot(tl.trans(_dx(dsx, x, eps, SCORE).to(a.dtype)), a, out_dtype=ACC, input_precision=PREC)
        dcb += tl.sum(ds, 0)
    nb = pid_g * NB + offs_n
    _store_rows(DB, nb, offs_n, NB, db * scale, D, DA)
    tl.store(DCB + nb, dcb, mask=offs_n < NB)
    if HAS_V:
        _store_rows(DV_, nb, offs_n, NB, dv, DV, DVA)


@triton.jit
def _bwd_rows_kernel(
    A, B, V, CB, M, DO, L, DELTA, CB2, L2, DELTA2, WG, DA_, scale, eps, H, NA, NB, DA, DVA,
    sab, sah, san, sad, sbb, sbh, sbn, sbd, svb, svh, svn, svd, scb, sch, scn,
    smb, smh, smi, smj, sdob, sdoh, sdon, sdod, slb, slh, sln,
    CAUSAL: tl.constexpr, HAS_V: tl.constexpr, HAS_MASK: tl.constexpr, SCORE: tl.constexpr,
    DUAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``da`` for one block of rows (a loop over the columns)."""
    pid_m, pid_g, ob, oh, offs_m = _program(H, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    a = _load_tile(A, ob, oh, sab, sah, san, sad, offs_m, NA, offs_d, DA)
    lse = _load_lse(L, ob, oh, slb, slh, sln, offs_m, NA, ACC)
    delta = tl.load(DELTA + pid_g * NA + offs_m, mask=offs_m < NA, other=0.0).to(ACC)
    do = tl.load(DO + ob * sdob + oh * sdoh + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                 mask=(offs_m[:, None] < NA) & (offs_dv[None, :] < DVA) & HAS_V, other=0.0)
    da = tl.zeros([BLOCK_M, D], ACC)
    if DUAL:
        wgt = tl.load(WG + pid_g).to(ACC)
        lse2 = _load_lse(L2, ob, oh, slb, slh, sln, offs_m, NA, ACC)
        delta2 = tl.load(DELTA2 + pid_g * NA + offs_m, mask=offs_m < NA, other=0.0).to(ACC)
    lo, hi = _span(pid_m, NB, CAUSAL == 1, CAUSAL == 2, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, s, b, x, s0 = _row_tile(
            a, B, CB, M, ob, oh, offs_m, start_n, offs_d, sbb, sbh, sbn, sbd, scb, sch, scn, smb, smh, smi,
            smj, NA, NB, DA, scale, eps, CAUSAL, HAS_MASK, SCORE, BLOCK_N, ACC, PREC)
        p = tl.exp(s - lse[:, None])
        if HAS_V:
            v = _load_tile(V, ob, oh, svb, svh, svn, svd, offs_n, NB, offs_dv, DVA)
            dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
            if DUAL:
                cb2 = tl.load(CB2 + ob * scb + oh * sch + offs_n * scn, mask=offs_n < NB,
                              other=float("-inf")).to(ACC)
                p2 = tl.exp(s0 + cb2[None, :] - lse2[:, None])
                ds = p * (wgt * dp - delta[:, None]) + p2 * ((1.0 - wgt) * dp - delta2[:, None])
            else:
                ds = p * (dp - delta[:, None])
        else:
            ds = p * (-delta[:, None])
        da += tl.dot(_dx(ds, x, eps, SCORE).to(b.dtype), b, out_dtype=ACC, input_precision=PREC)
    _store_rows(DA_, pid_g * NA + offs_m, offs_m, NA, da * scale, D, DA)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _blocks(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head size ``d`` (GPU tuning lives here)."""
    if BLOCKS[0] is not None:
        bm, bn = BLOCKS[0]
        return bm, bn, 4, 1
    if INTERPRETED:
        return 32, 32, 4, 1
    if dtype in (torch.float32, torch.float64) or d > 128:
        return 64, 32, 4, 2
    return (128, 64, 8, 3) if d <= 64 else (64, 64, 4, 2)


def _meta(a: Tensor) -> tuple[Any, str]:
    if a.dtype == torch.float64:
        return tl.float64, "ieee"
    return tl.float32, "ieee" if a.dtype == torch.float32 else "tf32"


def _launch_fwd(
    a: Tensor, b: Tensor, v: Tensor | None, cb: Tensor, mask: Tensor | None, causal: int, scale: float,
    score: int, eps: float, dual: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run :func:`_fwd_kernel`; ``dual = (cb2, wg, o2, lse2)`` adds the second pass (outputs in place)."""
    batch, heads, na, da = a.shape
    nb = b.shape[2]
    dva = 1 if v is None else v.shape[3]
    acc, prec = _meta(a)
    lse = torch.empty((batch, heads, na), dtype=torch.float64 if a.dtype == torch.float64 else torch.float32,
                      device=a.device)
    out = a.new_empty((batch, heads, na, dva)) if v is not None else a.new_empty((0,))
    bm, bn, warps, stages = _blocks(da, a.dtype)
    grid = (triton.cdiv(na, bm), batch * heads)
    vv = b if v is None else v
    mm = cb if mask is None else mask
    ms = (0, 0, 0, 0) if mask is None else tuple(mask.stride())
    os_ = (0, 0, 0, 0) if v is None else tuple(out.stride())
    cb2, wg, o2, lse2 = (cb, cb, out, lse) if dual is None else dual
    wrap_triton(_fwd_kernel)[grid](
        a, b, vv, cb, mm, out, lse, cb2, o2, lse2, wg, scale, eps, heads, na, nb, da, dva,
        *a.stride(), *b.stride(), *vv.stride(), *cb.stride(), *ms, *os_, *lse.stride(),
        CAUSAL=causal, HAS_V=v is not None, HAS_MASK=mask is not None, SCORE=score, DUAL=dual is not None,
        D=_pow2(da), DV=_pow2(dva), BLOCK_M=bm, BLOCK_N=bn, ACC=acc, PREC=prec, num_warps=warps,
        num_stages=stages,
    )
    return out, lse


def _launch_bwd(
    do: Tensor | None, delta: Tensor, a: Tensor, b: Tensor, v: Tensor | None, cb: Tensor, mask: Tensor | None,
    lse: Tensor, causal: int, scale: float, score: int, eps: float,
    dual: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run both backward kernels; ``dual = (cb2, wg, lse2, delta2)``. Returns ``(da, db, dv, dcb)``."""
    batch, heads, na, da = a.shape
    nb = b.shape[2]
    has_v = v is not None and do is not None
    dva = v.shape[3] if v is not None else 1
    d_pad, dv_pad = _pow2(da), _pow2(dva)
    acc, prec = _meta(a)
    # gradients in padded contiguous buffers (the kernels write whole rows), trimmed below
    ga = torch.empty((batch, heads, na, d_pad), dtype=a.dtype, device=a.device)
    gb = torch.empty((batch, heads, nb, d_pad), dtype=b.dtype, device=a.device)
    gv = torch.empty((batch, heads, nb, dv_pad) if has_v else (0,), dtype=a.dtype, device=a.device)
    gcb = torch.empty((batch, heads, nb), dtype=lse.dtype, device=a.device)
    bm, bn, warps, stages = _blocks(da, a.dtype)
    vv = v if v is not None else b
    dd = do if has_v and do is not None else b
    mm = cb if mask is None else mask
    ms = (0, 0, 0, 0) if mask is None else tuple(mask.stride())
    cb2, wg, lse2, delta2 = (cb, cb, lse, delta) if dual is None else dual
    common = dict(CAUSAL=causal, HAS_V=has_v, HAS_MASK=mask is not None, SCORE=score, DUAL=dual is not None,
                  D=d_pad, DV=dv_pad, BLOCK_M=bm, BLOCK_N=bn, ACC=acc, PREC=prec, num_warps=warps,
                  num_stages=stages)
    strides = (*a.stride(), *b.stride(), *vv.stride(), *cb.stride(), *ms, *dd.stride(), *lse.stride())
    extra = (cb2, lse2, delta2, wg)
    wrap_triton(_bwd_cols_kernel)[(triton.cdiv(nb, bn), batch * heads)](
        a, b, vv, cb, mm, dd, lse, delta, *extra, gb, gv, gcb, scale, eps, heads, na, nb, da, dva, *strides,
        **common)
    wrap_triton(_bwd_rows_kernel)[(triton.cdiv(na, bm), batch * heads)](
        a, b, vv, cb, mm, dd, lse, delta, *extra, ga, scale, eps, heads, na, nb, da, dva, *strides, **common)
    gv_out = gv[..., :dva] if has_v else gv
    return ga[..., :da], gb[..., :da], gv_out, gcb


@triton_op("attnopt::triton_flash", mutates_args=())
def _flash_fwd(
    a: Tensor, b: Tensor, v: Tensor | None, cb: Tensor, mask: Tensor | None, causal: int, scale: float,
    score: int, eps: float,
) -> tuple[Tensor, Tensor]:
    return _launch_fwd(a, b, v, cb, mask, causal, scale, score, eps)


@triton_op("attnopt::triton_flash_backward", mutates_args=())
def _flash_bwd(
    dout: Tensor | None, dlse: Tensor, a: Tensor, b: Tensor, v: Tensor | None, cb: Tensor,
    mask: Tensor | None, out: Tensor | None, lse: Tensor, causal: int, scale: float, score: int, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pot = lse.dtype
    if v is not None and dout is not None and out is not None:
        delta = (dout.to(pot) * out.to(pot)).sum(-1) - dlse.to(pot)
    else:
        dout, delta = None, -dlse.to(pot)
    return _launch_bwd(dout, delta.contiguous(), a, b, v, cb, mask, lse, causal, scale, score, eps)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    a, b, v, cb, mask, causal, scale, score, eps = inputs
    out, lse = output
    ctx.causal, ctx.scale, ctx.has_v, ctx.score, ctx.eps = causal, scale, v is not None, score, eps
    ctx.save_for_backward(a, b, v, cb, mask, out if v is not None else None, lse)


def _backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    a, b, v, cb, mask, out, lse = ctx.saved_tensors
    ga, gb, gv, gcb = _flash_bwd(dout if ctx.has_v else None, dlse, a, b, v, cb, mask, out, lse,
                                 ctx.causal, ctx.scale, ctx.score, ctx.eps)
    return ga, gb, (gv if ctx.has_v else None), gcb, None, None, None, None, None


_flash_fwd.register_autograd(_backward, setup_context=_setup)


@triton_op("attnopt::triton_hnas", mutates_args=())
def _hnas_fwd(
    q: Tensor, k: Tensor, v: Tensor, cb: Tensor, cb2: Tensor, mask: Tensor | None, wg: Tensor, causal: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    wg = wg.contiguous()  # read by (batch, head) index
    o2 = q.new_empty((*q.shape[:3], v.shape[3]))
    lse2 = torch.empty(q.shape[:3], dtype=cb.dtype, device=q.device)
    o1, lse1 = _launch_fwd(q, k, v, cb, mask, causal, scale, 0, 0.0, (cb2, wg, o2, lse2))
    w = wg[..., None, None]
    out = (w * o1.to(wg.dtype) + (1 - w) * o2.to(wg.dtype)).to(q.dtype)
    return out, o1, o2, lse1, lse2


@triton_op("attnopt::triton_hnas_backward", mutates_args=())
def _hnas_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cb: Tensor, cb2: Tensor, mask: Tensor | None, wg: Tensor,
    o1: Tensor, o2: Tensor, lse1: Tensor, lse2: Tensor, causal: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    pot = lse1.dtype
    wg = wg.contiguous()
    d1 = (dout.to(pot) * o1.to(pot)).sum(-1)
    d2 = (dout.to(pot) * o2.to(pot)).sum(-1)
    w = wg.to(pot)[..., None]
    delta, delta2 = (w * d1).contiguous(), ((1 - w) * d2).contiguous()
    dq, dk, dv, dcb = _launch_bwd(dout.to(q.dtype), delta, q, k, v, cb, mask, lse1, causal, scale, 0, 0.0,
                                  (cb2, wg, lse2, delta2))
    return dq, dk, dv, dcb, (d1 - d2).sum(-1).to(wg.dtype)


def _hnas_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, cb, cb2, mask, wg, causal, scale = inputs
    _, o1, o2, lse1, lse2 = output
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, cb, cb2, mask, wg, o1, o2, lse1, lse2)


def _hnas_backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    q, k, v, cb, cb2, mask, wg, o1, o2, lse1, lse2 = ctx.saved_tensors
    dq, dk, dv, dcb, dwg = _hnas_bwd(dout, q, k, v, cb, cb2, mask, wg, o1, o2, lse1, lse2, ctx.causal,
                                     ctx.scale)
    return dq, dk, dv, dcb, None, None, dwg, None, None


_hnas_fwd.register_autograd(_hnas_backward, setup_context=_hnas_setup)


def hnas_attention(
    q: Tensor, k: Tensor, v: Tensor, cb: Tensor, cb2: Tensor, mask: Tensor | None, wg: Tensor, causal: int,
    scale: float,
) -> Tensor:
    """``w·o¹ + (1 − w)·o²``: two softmax passes over the same scores in one kernel, column biases
    ``cb`` (differentiable) and ``cb2`` (not), ``wg (B, H)`` the per-(batch, head) weight in the
    potential dtype (differentiable). One score tile feeds both passes, forward and backward
    (``dv = (w P¹ + (1 − w) P²)ᵀ do``, ``dt = P¹(w dP − Δ¹) + P²((1 − w) dP − Δ²)``): HNAS costs
    one attention pass plus DNAS's column pass. Returns ``(B, H, Nq, dv)`` in ``q``'s dtype."""
    return _hnas_fwd(q, k, v, cb, cb2, mask, wg, causal, scale)[0]


def flash(
    a: Tensor, b: Tensor, v: Tensor | None, cb: Tensor, mask: Tensor | None, causal: int, scale: float,
    score: int = 0, eps: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``(o, ℓ)`` of the module docstring (``o`` empty without ``v``).

    Args:
        a: (B, H, Na, d) rows. b: (B, H, Nb, d) columns. v: (B, H, Nb, dv) values or None.
        cb: (B, H, Nb) column bias in the potential dtype (float32, float64 for float64 input),
            ``-inf`` = excluded.
        mask: additive (B, H, Na, Nb) view (any strides, stride 0 allowed) or None.
        causal: 0 none, 1 ``j <= i``, 2 ``j >= i``.
        scale: score scale (SCORE 0).
        score: 0: ``t = scale·<a_i, b_j>``; 1: ``t = log(<a_i, b_j>² + eps)`` (squared feature
            kernels: ``a``, ``b`` are feature maps, implicit-kernel attention).
        eps: the ``ε`` of score 1.
    Returns:
        ``o (B, H, Na, dv)`` in ``a``'s dtype and ``ℓ (B, H, Na)`` in the potential dtype.
    """
    return _flash_fwd(a, b, v, cb, mask, causal, scale, score, eps)
