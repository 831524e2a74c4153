r"""Exact CPU forward of 1.5-entmax in two streaming passes per row block (internal).

With ``z = x − max x`` the map is ``p = ([z − c]₊ / 2)²``, the threshold ``c`` the root of
``F(c) = ‖[z − c]₊‖₂ − 2`` (convex, decreasing, ``c ∈ [−2, 0]``). From *any* guess ``c₀``, one
pass over the row gives ``k = |S|``, ``s₁ = Σ_S v``, ``s₂ = Σ_S v²`` on ``S = {z > c₀}``
(``v = z − c₀``), and with them

* the sort algorithm's closed form on ``S`` (Peters et al., 2019): the smaller root
  ``c_S = c₀ + δ``, ``δ = (s₁ − √(s₁² − k(s₂ − 4)))/k``, of ``Σ_S (z − c)² = 4``;
* the Newton iterate ``c_N = c₀ + (‖v‖ − 2)‖v‖/s₁``, a lower bound on the root (``F`` convex).

``c_S`` is the threshold iff ``{z > c_S} = S``. The second pass writes ``o = [z − c_S]₊`` and
checks it: ``Σo = s₁ − kδ`` exactly when no entry is on the other side of ``c_S`` than of
``c₀`` (each one that is adds ``|z − c_S|``, so one that escapes the rounding slack carries
``p ≈ 0``), and ``|‖o‖²/4 − 1| ≤ tol`` (guards the cancellation in the root). Such rows are
done: ``p = o²/‖o‖²``, the sort algorithm's result to rounding. Both passes work on
``d = x − (m + c₀)``, kept from the first for the second (``o = [d − δ]₊``): the row max is
never subtracted on its own and the small ``δ`` keeps its digits.

The guess is the threshold of the row's strided group maxima (``n/4`` entries, a subset):
two Newton steps from ``c = −2`` and the closed form on them. Rows whose check fails (a few %,
mostly support entries sharing a group) are gathered and rerun from their Newton bound
``c_N``, twice; what still fails goes to the dense solver. A row block (2¹⁸ entries) stays in
cache for its ~13 streaming ops: no sort, no gather of candidates, no per-iteration sync.
"""
from __future__ import annotations

import queue
from collections.abc import Callable

import torch
from torch import Tensor

from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.regularized import groups as _groups

__all__ = ["entmax15_passes"]

_GROUP = 4  # strided groups whose maxima give the first guess (a subset of the row)
_LB_ITERS = 2  # Newton steps on the group maxima before their closed form
_RETRIES = 2  # reruns of the failing rows from their Newton lower bound

#: ``dense(z_rows (F, n), c0 (F, 1)) -> (p, c)``: the exact dense solver in ``z`` units.
Dense = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def _stats(x: Tensor, c: Tensor, d: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(k, s₁, ‖v‖)`` of ``v = [x − c]₊`` along the last dim; ``d = x − c`` is kept, ``w`` is scratch."""
    torch.clamp_min(torch.sub(x, c, out=d), 0.0, out=w)
    s1 = w.sum(dim=-1, keepdim=True)
    nrm = torch.linalg.vector_norm(w, 2, dim=-1, keepdim=True)
    k = torch.sign(w, out=w).sum(dim=-1, keepdim=True)
    return k, s1, nrm


def _closed(c: Tensor, k: Tensor, s1: Tensor, nrm: Tensor) -> Tensor:
    """Smaller root of ``Σ_S (z − c')² = 4`` (clamped when there is none: then the check fails)."""
    kk = k.clamp_min_(1)
    disc = torch.addcmul(s1 * s1, kk, nrm * nrm - 4, value=-1.0)
    return torch.addcdiv(c, s1 - disc.clamp_min_(0).sqrt_(), kk)


def _newton(c: Tensor, s1: Tensor, nrm: Tensor) -> Tensor:
    """Newton iterate on ``‖[z − c]₊‖ − 2`` (``c`` itself where ``S`` is empty)."""
    return torch.addcdiv(c, (nrm - 2).mul_(nrm), s1.clamp_min(torch.finfo(s1.dtype).tiny))


def _solve(x: Tensor, c0: Tensor, out: Tensor, d: Tensor, tol: float) -> tuple[Tensor, Tensor]:
    """Two passes from the guess ``c0`` (score units); writes ``p`` into ``out`` where the check passes.

    The second pass is ``o = [d − δ]₊`` with ``d = x − c₀`` from the first and ``δ = c_S − c₀``:
    the row max is never subtracted from ``x``, and ``δ`` (small) keeps its digits. ``out`` is
    also the first pass's scratch. Returns ``(δ, c_N or nan)``: the closed-form step, and
    for the rows where it is not exact the Newton lower bound to restart from (NaN where it is
    exact). All −inf rows (``‖o‖ = 0``) count as exact: their ``p`` is 0.
    """
    k, s1, nrm = _stats(x, c0, d, out)
    cn = _newton(c0, s1, nrm)
    delta = _closed(torch.zeros_like(c0), k, s1, nrm)
    o = torch.sub(d, delta, out=out).relu_()
    n2 = torch.linalg.vector_norm(o, 2, dim=-1, keepdim=True).square_()
    # Σo = s₁ − kδ iff no entry changed side ({x > c_S} = S); a misclassified entry adds
    # |x − c_S|, so an undetected one lies within rounding of c_S (and carries p ≈ 0)
    lin = torch.addcmul(s1, k, delta, value=-1.0)
    slack = torch.addcmul(s1, k, delta.abs()).mul_(64 * torch.finfo(o.dtype).eps)
    same_side = (o.sum(dim=-1, keepdim=True) - lin).abs_() <= slack
    exact = (same_side & ((n2 * 0.25 - 1).abs_() <= tol)) | (n2 == 0)
    o.square_().mul_(n2.clamp_min(torch.finfo(n2.dtype).tiny).reciprocal_())
    return delta, cn.masked_fill_(exact, float("nan"))


def _guess(gmax: Tensor) -> Tensor:
    """A guess of the row threshold from the (shifted) group maxima: Newton, then the closed form."""
    v = torch.empty_like(gmax)
    c = torch.full_like(gmax[:, :1], -2.0)
    for _ in range(_LB_ITERS):
        torch.sub(gmax, c, out=v).relu_()
        c = _newton(c, v.sum(dim=-1, keepdim=True), torch.linalg.vector_norm(v, 2, dim=-1, keepdim=True))
    return _closed(c, *_stats(gmax, c, v, v))


def entmax15_passes(x: Tensor, tol: float, dense: Dense) -> tuple[Tensor, Tensor]:
    """``(p, θ)`` of 1.5-entmax along the last dim of a ``usable`` CPU tensor ``x``.

    ``θ = c/2`` is the threshold of ``[(x − max x)/2 − θ]₊²`` (the dense solver's units).

    Raises:
        ValueError: NaN or ``+inf`` in ``x``.
    """
    n = x.shape[-1]
    flat = x.view(-1, n)
    rows = flat.shape[0]
    out = torch.empty_like(flat)
    m = torch.empty((rows, 1), dtype=x.dtype, device=x.device)  # row max (−inf rows: 0)
    c = torch.empty_like(m)  # threshold, relative to the row max
    c_next = torch.empty_like(m)  # Newton restart point (score units), NaN where c is exact
    step = max(1, THRESHOLDS.entmax15_passes_block_entries // n)
    pool: queue.SimpleQueue[Tensor] = queue.SimpleQueue()  # cache-sized scratch, one per worker
    for _ in range(min(torch.get_num_threads(), -(-rows // step))):
        pool.put(torch.empty((3, step, n), dtype=x.dtype, device=x.device))

    def first(r0: int, r1: int) -> bool:
        buf = pool.get()
        r = r1 - r0
        xb = flat[r0:r1]
        gmax = xb.view(r, _GROUP, n // _GROUP).amax(dim=1)
        mb = torch.amax(gmax, dim=-1, keepdim=True, out=m[r0:r1])
        mb.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)  # NaN stays: checked below
        c0 = _guess(gmax.sub_(mb))
        delta, c_next[r0:r1] = _solve(xb, c0 + mb, out[r0:r1], buf[0, :r], tol)
        torch.add(c0, delta, out=c[r0:r1])
        pool.put(buf)
        return True

    _groups.run_blocks(first, [(i, min(rows, i + step)) for i in range(0, rows, step)])
    if bool((torch.isnan(m) | torch.isposinf(m)).any()):
        raise ValueError("scores must not contain NaN or +inf (use -inf to mask an entry)")
    bad = (~torch.isnan(c_next)).view(-1).nonzero().view(-1)

    def rerun(i0: int, i1: int) -> bool:  # rows bad[i0:i1], gathered into the scratch
        buf = pool.get()
        idx, f = bad[i0:i1], i1 - i0
        xs = torch.index_select(flat, 0, idx, out=buf[0, :f])
        c0 = c_next.index_select(0, idx)
        delta, cn = _solve(xs, c0, buf[1, :f], buf[2, :f], tol)
        out.index_copy_(0, idx, buf[1, :f])
        c.index_copy_(0, idx, c0.sub_(m.index_select(0, idx)).add_(delta))
        c_next.index_copy_(0, idx, cn)
        pool.put(buf)
        return True

    for _ in range(_RETRIES):
        if bad.numel() == 0:
            break
        _groups.run_blocks(rerun, [(i, min(bad.numel(), i + step)) for i in range(0, bad.numel(), step)])
        bad = bad[~torch.isnan(c_next.index_select(0, bad)).view(-1)]
    if bad.numel():  # what the reruns did not settle: the dense solver, from c_N
        mbad = m.index_select(0, bad)
        p, cb = dense(flat.index_select(0, bad).sub_(mbad), c_next.index_select(0, bad).sub_(mbad))
        out.index_copy_(0, bad, p)
        c.index_copy_(0, bad, cb)
    return out.view(x.shape), c.mul_(0.5).view(*x.shape[:-1], 1)
