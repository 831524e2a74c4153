r"""Fused materialized sparsemax / α-entmax attention for short sequences (internal).

sdpa-one-sided-eot Prop. 4.2–4.3. Scores ``S = scale·QKᵀ + M − β|i−j|`` are formed once (for
α = 1.5 directly in map units ``z = S/2``: the ½ rides on the scale of ``Q``), and the map
``P = [z − θ]₊^{1/(α−1)}`` is found *in place* on them, row-wise, by an exact threshold search
on the whole row block (no shift by the row max, no second score-sized buffer for sparsemax):

* α = 2 (sparsemax): Michelot's algorithm from the lower bound ``θ = max − 1`` — each step
  ``θ ← θ + (Σ[z − θ]₊ − 1)/|S|`` on the support ``S = {z > θ}``; it stops when ``|S|`` does
  not change, and then ``[z − θ]₊`` *is* ``P`` (exact).
* α = 1.5: Newton on ``‖[z − θ]₊‖ − 1`` (convex and decreasing, so monotone from that lower
  bound; two unchecked steps first), then at each step the closed-form threshold ``τ`` of the
  current support ``S`` (the quadratic of the sort-based algorithm) is tried: ``τ`` is exact iff
  ``S`` is the support — a support that is too large gives ``τ`` above the true threshold, an
  extra entry of ``S`` falls below it and ``Σ[z − τ]₊² < 1`` — so ``τ`` is taken once
  ``|Σ[z − τ]₊² − 1| ≤ tol`` (or Newton's step is below rounding). Then ``g = [z − τ]₊ = √P``
  and ``P = g²`` (exact to rounding once the support is found).
* other α, and α ∈ {1.5, 2} from ``THRESHOLDS.sparse_native_min_entries`` scores on: the map
  implementation the router chose (``kernels.forward``: the C kernel of :mod:`.cpu` for 1.5 / 2).

Rows longer than a cache-sized block are processed in row blocks, so the search's passes run
in cache. Rows that are entirely masked give ``P = 0`` (and zero gradient).

Backward (closed form, no recomputation; ``P`` and, for α ≠ 2, ``g = p^{2−α}`` are saved):
``dP = dO Vᵀ``, ``dS = g ⊙ (dP − Σ g dP / Σ g)`` (``g`` = the support indicator for
sparsemax, ``Σ g = |S|`` from the forward), ``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``,
``dV = Pᵀ dO``, ``dβ = −Σ dS ⊙ |i − j|``. ``dS`` is formed in place on ``dP``.

Why the backward is dense-masked, not sparse (measured, not assumed): supports are small
(Gaussian scores: sparsemax ~4 keys of 64–512, 1.5-entmax 10–17, densities 0.8–3 % at N = 512),
yet at N ≤ 512 the four ``N×N×d`` products as dense BLAS ``bmm`` beat every sparse form once
the support has to be *found*. One backward, float32, one thread, best of 5, loaded 2-core
machine (``to_sparse_csr`` of ``P`` + ``torch.sparse.sampled_addmm`` for ``dP`` on the support +
CSR ``dS K``, ``dSᵀ Q``, ``Pᵀ dO`` on a block-diagonal layout, vs the dense path here):

=============  ======  ==========  =============  ========================
B·H, N         α       dense (ms)  CSR (ms)       of which ``to_sparse_csr``
=============  ======  ==========  =============  ========================
8, 128         2       0.61        2.04           0.66
8, 256         2       2.67        4.56           1.78
8, 512         2       15.1        17.3           8.5
64, 256        2       28.4        41.7           27.5
64, 512        2       137         145            107
8, 512         1.5     11.2        38.4           12.6
64, 512        1.5     127         344            107
=============  ======  ==========  =============  ========================

(With the CSR structure given for free the sparse products win for sparsemax at N = 512 —
4.1 vs 12.0 ms at B·H = 8 — but the compaction of ``P`` (``nonzero``) costs more than that on
CPU; a padded gather of the support's key/value rows, ``index_select`` + ``index_add_``, was 2–23×
slower than dense.) The support is used where it pays: ``dS`` is zero off the support by
construction (``g = 0`` there) and formed with three in-place passes over ``dP`` per
cache-sized row block; the zeros of ``dS`` and ``P`` are what a GPU kernel with a block-sparse
product would skip (not built).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._validation import broadcast_shapes
from attnopt.functional._autograd import double_backward, records_graph, tracked_vjp
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.regularized._common import MapKernels, default_tol

__all__ = ["fused_sparse_attention"]

_MAX_ITER_SPARSEMAX = 1000
_MAX_ITER_ENTMAX = 100
_NEWTON_FIRST = 2  # unchecked Newton steps of the 1.5-entmax search (measured: 3-5 in all)


def _distance(nq: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    pos = torch.arange(nq, device=device)[:, None] - torch.arange(nk, device=device)[None, :]
    return pos.abs().to(dtype)


def _scores(
    q: Tensor, k: Tensor, batch: tuple[int, ...], mult: float, mask: Tensor | None, beta: Tensor | None,
    causal: bool, half: bool,
) -> Tensor:
    """``mult·QKᵀ + c·(M − β|i−j|)`` as a contiguous ``(*batch, Nq, Nk)`` tensor (``c = ½`` if ``half``)."""
    nq, nk = q.shape[-2], k.shape[-2]
    s = torch.bmm(q * mult, k.transpose(-2, -1)).view(*batch, nq, nk)
    if mask is not None:
        s.add_(mask, alpha=0.5 if half else 1.0)
    if beta is not None:
        dist = _distance(nq, nk, beta.dtype, s.device)
        bias = beta * dist if beta.dim() == 0 else beta.view(-1, 1, 1) * dist
        s.sub_(bias.to(s.dtype), alpha=0.5 if half else 1.0)
    if causal:
        s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _start(z: Tensor) -> Tensor:
    """The lower bound ``max z − 1`` of every row's threshold (``−1`` on an all ``−inf`` row)."""
    m = z.amax(dim=-1, keepdim=True)
    if not bool(m.max() < float("inf")):  # NaN or +inf somewhere (the max propagates NaN)
        raise ValueError("attention scores must not contain NaN or +inf (use -inf to mask an entry)")
    return m.masked_fill_(torch.isneginf(m), 0.0).sub_(1.0)


def _warn(name: str, max_iter: int) -> None:
    warnings.warn(f"{name} attention: threshold search did not converge in {max_iter} iterations",
                  RuntimeWarning, stacklevel=5)


def _count(t: Tensor, buf: Tensor) -> Tensor:
    """Entries ``> 0`` per row of ``t ≥ 0`` as floats ``(R, 1)`` (``sign`` + ``sum``: a bool ``sum``
    or ``count_nonzero`` is ~8x slower on CPU)."""
    return torch.sign(t, out=buf).sum(dim=-1, keepdim=True)


def _sparsemax_rows(t: Tensor, buf: Tensor) -> Tensor:
    """Sparsemax of the rows of ``t (R, n)``, in place; returns the support sizes ``(R, 1)``.

    Works on ``t = [z − θ]₊`` itself: ``θ`` only grows, so entries at 0 never return.
    ``buf``: scratch of ``t``'s shape.
    """
    t.sub_(_start(t)).relu_()
    count_prev: Tensor | None = None
    for _ in range(_MAX_ITER_SPARSEMAX):
        count = _count(t, buf)
        if count_prev is not None and torch.equal(count, count_prev):
            break
        # Michelot: θ ← θ + (Σ_S (z − θ) − 1)/|S| (≥ 0 from a lower bound; 0 on empty rows)
        t.sub_(t.sum(dim=-1, keepdim=True).sub_(1.0).div_(count.clamp_min(1.0)).clamp_min_(0.0)).relu_()
        count_prev = count
    else:
        _warn("sparsemax", _MAX_ITER_SPARSEMAX)
    return count


def _newton15(t: Tensor, s1: Tensor, norm: Tensor) -> Tensor:
    """One Newton step on ``h(θ) = ‖[z − θ]₊‖ − 1`` (convex, decreasing: monotone from below)
    in place on ``t = [z − θ]₊`` from its ``Σt`` and ``‖t‖``; returns the step."""
    step = (norm - 1.0).mul_(norm).div_(s1.clamp_min(torch.finfo(t.dtype).tiny)).clamp_min_(0.0)
    t.sub_(step).relu_()
    return step


def _entmax15_rows(t: Tensor, g: Tensor, tol: float) -> Tensor:
    """1.5-entmax of the rows of ``t (R, n)`` (map units): ``g = √p`` into ``g``, ``p`` into ``t``.

    Returns ``Σ g`` per row ``(R, 1)`` (the backward's normalizer).
    """
    t.sub_(_start(t)).relu_()
    for _ in range(_NEWTON_FIRST):  # from max − 1 the support is never right yet: no check
        _newton15(t, t.sum(dim=-1, keepdim=True), torch.linalg.vector_norm(t, 2, dim=-1, keepdim=True))
    eps = torch.finfo(t.dtype).eps
    for _ in range(_MAX_ITER_ENTMAX):
        k = _count(t, g).clamp_min_(1.0)
        s1 = t.sum(dim=-1, keepdim=True)
        norm = torch.linalg.vector_norm(t, 2, dim=-1, keepdim=True)
        # closed form on S = {z > θ}: Σ_S (t − δ)² = 1, smaller root; τ = θ + δ ≥ the threshold,
        # = it iff S is the support (else an entry of S falls below τ and Σ[t − δ]₊² < 1)
        disc = torch.addcmul(s1 * s1, k, norm * norm - 1.0, value=-1.0).clamp_min_(0.0)
        delta = (s1 - disc.sqrt_()).div_(k).clamp_min_(0.0)
        torch.sub(t, delta, out=g).relu_()
        if bool(torch.linalg.vector_norm(g, 2, dim=-1).square_().sub_(1.0).abs_().max() <= tol):
            break
        if bool(_newton15(t, s1, norm).max() <= 2 * eps):
            break  # Newton has converged to rounding: g (before the step) is this support's answer
    else:
        _warn("entmax(alpha=1.5)", _MAX_ITER_ENTMAX)
    torch.square(g, out=t)
    return g.sum(dim=-1, keepdim=True)


def _block_rows(n: int) -> int:
    return max(1, THRESHOLDS.sparse_row_block_entries // max(n, 1))


def _by_blocks(rows: int, n: int, fn: Any) -> None:
    """Call ``fn(i, j)`` on cache-sized row blocks ``[i, j)`` of ``rows`` rows of length ``n``."""
    step = _block_rows(n)
    if rows <= 2 * step:
        fn(0, rows)
        return
    for i in range(0, rows, step):
        fn(i, min(rows, i + step))


def _per_row_blocks(fn: Callable[[int, int], Tensor], rows: int, n: int) -> Tensor:
    """``fn(i, j) -> (j − i, 1)`` on cache-sized row blocks, concatenated (one call if few rows)."""
    step = _block_rows(n)
    if rows <= 2 * step:
        return fn(0, rows)
    return torch.cat([fn(i, min(rows, i + step)) for i in range(0, rows, step)])


def _ds_rows(dp: Tensor, g: Tensor | None, p: Tensor, gsum: Tensor) -> None:
    """``dP ← g ⊙ (dP − Σ g dP / Σ g)`` in place on ``(R, n)`` rows (``g = 1[p > 0]`` if None)."""
    rows, n = dp.shape
    buf = torch.empty((min(rows, _block_rows(n) * 2), n), dtype=dp.dtype, device=dp.device) \
        if g is None else None

    def block(i: int, j: int) -> None:
        w = torch.sign(p[i:j], out=buf[: j - i]) if buf is not None else g[i:j]  # type: ignore[index]
        d = dp[i:j].mul_(w)
        c = d.sum(dim=-1, keepdim=True).div_(gsum[i:j].clamp_min(torch.finfo(dp.dtype).tiny))
        d.addcmul_(w, c, value=-1.0)

    _by_blocks(rows, n, block)



def _plain_vjp(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    """Both Functions' backward in tracked plain ops (``create_graph=True``: exact double backward)."""
    saved = ctx.saved_tensors

    def attend(*xs: Any) -> Tensor:  # the forward's inputs; q, k, v flattened to (B·H, N, ·)
        qkv = (x.view(*ctx.batch, *x.shape[-2:]) for x in xs[:3])
        out = ctx.kernels.tracked(*qkv, xs[4], xs[5], ctx.alpha, ctx.scale, ctx.causal)
        return out.reshape(-1, *out.shape[-2:])

    return tracked_vjp(ctx, attend, (*saved[:3], None, ctx.mask, saved[-1], None, None, None, None), dout)


class _FusedSparseAttention(torch.autograd.Function):
    """α ∈ {1.5, 2}: the in-place threshold search above, ``P`` (and ``√P``) saved."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, batch: tuple[int, ...], mask: Tensor | None,
        beta: Tensor | None, alpha: float, scale: float, causal: bool, kernels: MapKernels,
    ) -> Tensor:
        entmax15 = alpha == 1.5
        b = beta.detach() if beta is not None else None
        s = _scores(q, k, batch, scale * 0.5 if entmax15 else scale, mask, b, causal, entmax15)
        nq, nk = s.shape[-2], s.shape[-1]
        s2 = s.view(-1, nk)
        rows = s2.shape[0]
        tol = default_tol(s.dtype)
        if entmax15:
            g_full = torch.empty_like(s2)
            gsum = _per_row_blocks(lambda i, j: _entmax15_rows(s2[i:j], g_full[i:j], tol), rows, nk)
            p, g = s, g_full.view(-1, nq, nk)
        else:
            buf = torch.empty((min(rows, _block_rows(nk) * 2), nk), dtype=s.dtype, device=s.device)
            gsum = _per_row_blocks(lambda i, j: _sparsemax_rows(s2[i:j], buf[: j - i]), rows, nk)
            p, g = s, None
        p3 = p.view(-1, nq, nk)
        ctx.scale, ctx.batch, ctx.alpha, ctx.mask, ctx.causal = scale, batch, alpha, mask, causal
        ctx.kernels = kernels
        ctx.save_for_backward(q, k, v, p3, g, gsum, beta)
        return torch.bmm(p3, v)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):
            return _plain_vjp(ctx, dout)
        q, k, v, p, g, gsum, beta = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        nk = p.shape[-1]
        ds = torch.bmm(dout, v.transpose(-2, -1))
        _ds_rows(ds.view(-1, nk), None if g is None else g.view(-1, nk), p.view(-1, nk), gsum)
        dq = dk = dv = dbeta = None
        if ctx.needs_input_grad[0]:
            dq = torch.bmm(ds, k).mul_(ctx.scale)
        if ctx.needs_input_grad[1]:
            dk = torch.bmm(ds.transpose(-2, -1), q).mul_(ctx.scale)
        if ctx.needs_input_grad[2]:
            dv = torch.bmm(p.transpose(-2, -1), dout)
        if beta is not None and ctx.needs_input_grad[5]:
            dist = _distance(p.shape[-2], nk, ds.dtype, ds.device)
            per = -(ds.view(*ctx.batch, p.shape[-2], nk) * dist).sum((-2, -1))
            dbeta = per.sum() if beta.dim() == 0 else per.reshape(-1, beta.shape[0]).sum(0)
            dbeta = dbeta.to(beta.dtype)
        return dq, dk, dv, None, None, dbeta, None, None, None, None


class _FusedEntmaxAttention(torch.autograd.Function):
    """Any float α > 1 on the map the router chose (``kernels.forward``), ``P`` saved."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, batch: tuple[int, ...], mask: Tensor | None,
        beta: Tensor | None, alpha: float, scale: float, causal: bool, kernels: MapKernels,
    ) -> Tensor:
        b = beta.detach() if beta is not None else None
        s = _scores(q, k, batch, scale, mask, b, causal, False)
        max_iter = _MAX_ITER_SPARSEMAX if alpha == 2.0 else _MAX_ITER_ENTMAX
        p = kernels.forward(s, alpha, -1, max_iter, default_tol(s.dtype))[0].view(-1, *s.shape[-2:])
        ctx.alpha, ctx.scale, ctx.batch, ctx.mask, ctx.causal = alpha, scale, batch, mask, causal
        ctx.kernels = kernels
        ctx.save_for_backward(q, k, v, p, beta)
        return torch.bmm(p, v)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):
            return _plain_vjp(ctx, dout)
        q, k, v, p, beta = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()
        dv = torch.bmm(p.transpose(-2, -1), dout)
        ds = ctx.kernels.backward(p, torch.bmm(dout, v.transpose(-2, -1)), ctx.alpha, -1)
        dq = torch.bmm(ds, k).mul_(ctx.scale)
        dk = torch.bmm(ds.transpose(-2, -1), q).mul_(ctx.scale)
        dbeta = None
        if beta is not None and ctx.needs_input_grad[5]:
            nq, nk = p.shape[-2], p.shape[-1]
            dist = _distance(nq, nk, ds.dtype, ds.device)
            per = -(ds.view(*ctx.batch, nq, nk) * dist).sum((-2, -1))
            dbeta = per.sum() if beta.dim() == 0 else per.reshape(-1, beta.shape[0]).sum(0)
            dbeta = dbeta.to(beta.dtype)
        return dq, dk, dv, None, None, dbeta, None, None, None, None


def _no_grad_forward(
    q: Tensor, k: Tensor, v: Tensor, batch: tuple[int, ...], mask: Tensor | None, beta: Tensor | None,
    alpha: float, scale: float, causal: bool, kernels: MapKernels,
) -> Tensor:
    """Inference: the scores (scale on the GEMM), the C map of :mod:`.cpu` (exact
    thresholds, rows it does not settle redone by the PyTorch search), ``P V``; nothing saved."""
    nq, nk = q.shape[-2], k.shape[-2]

    def scores() -> Tensor:
        s = torch.baddbmm(q.new_empty(1, 1, 1), q, k.transpose(-2, -1), beta=0.0, alpha=scale)
        s = s.view(*batch, nq, nk)
        if mask is not None:
            s.add_(mask)
        if beta is not None:
            dist = _distance(nq, nk, beta.dtype, s.device)
            s.sub_((beta * dist if beta.dim() == 0 else beta.view(-1, 1, 1) * dist).to(s.dtype))
        if causal:
            s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
        return s

    max_iter = _MAX_ITER_SPARSEMAX if alpha == 2.0 else _MAX_ITER_ENTMAX
    p, _, redo = kernels.native_forward(scores(), alpha, max_iter, in_place=True)  # P over S: no N×N alloc
    if redo.numel():  # rows the C search did not settle (rare): the whole map again, with its fallback
        p = kernels.forward(scores(), alpha, -1, max_iter, default_tol(q.dtype))[0]
    return torch.bmm(p.view(-1, nq, nk), v).view(*batch, nq, v.shape[-1])


def _native_map(q: Tensor, nk: int, kernels: MapKernels, min_entries: int | None = None) -> bool:
    """Whether the C sparse-map kernel runs the threshold search for these (flattened) queries."""
    limit = THRESHOLDS.sparse_native_min_entries if min_entries is None else min_entries
    return (q.shape[0] * q.shape[1] * nk >= limit and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and _native.has_storage(q)
            and kernels.native_available())


def fused_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, alpha: float, scale: float, mask: Tensor | None, beta: Tensor | None,
    is_causal: bool, kernels: MapKernels,
) -> Tensor:
    """Sparsemax (``alpha = 2``) / α-entmax attention on materialized scores (inputs validated).

    Same contract as :func:`attnopt.functional.regularized.streaming.blocked_sparse_attention`;
    ``kernels``: the map implementations the router chose.
    """
    orig = q.dtype
    compute = torch.float32 if orig in (torch.float16, torch.bfloat16) else orig
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    qkv = []
    for x in (q, k, v):
        x = x.to(compute)
        if tuple(x.shape[:-2]) != batch:
            x = x.expand(*batch, *x.shape[-2:])
        qkv.append(x.reshape(-1, *x.shape[-2:]))
    m = None if mask is None else mask.detach().to(compute)
    inference = not records_graph(*qkv, beta)
    no_grad_c = _native_map(qkv[0], k.shape[-2], kernels, THRESHOLDS.sparse_no_grad_native_min_entries)
    if alpha in (1.5, 2.0) and inference and no_grad_c:
        plain = _no_grad_forward(qkv[0], qkv[1], qkv[2], batch, m, beta, alpha, scale, is_causal, kernels)
        return plain if orig == compute else plain.to(orig)
    fn = _FusedSparseAttention if alpha in (1.5, 2.0) and not _native_map(qkv[0], k.shape[-2], kernels) \
        else _FusedEntmaxAttention
    out: Tensor = fn.apply(*qkv, batch, m, beta, alpha, scale, is_causal, kernels)
    return out.view(*batch, *out.shape[-2:]).to(orig)
