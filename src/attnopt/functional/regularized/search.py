r"""α-entmax for every α > 0 by a safeguarded Newton search on the threshold (internal leaf).

sdpa-one-sided-eot Prop. 4.3. The reference of α-entmax for ``α ∉ {1.5, 2}`` and for a tensor
``α`` (1.5 and 2 have exact sort-based references in :mod:`.sort` and C kernels in :mod:`.cpu`).
In the ``q``-exponential form ``p = exp(log1p(ε(s − m − τ))/ε)``, ``ε = α − 1`` (accurate as
``α → 1``), Newton on ``S(τ)^ε − 1`` from ``τ = 0`` rises monotonically to the root; it stops
when ``|Σp − 1| ≤ tol`` for every slice (a warning otherwise) and ``p`` is renormalized. Off the
host (a GPU, meta / fake tensors, a compiled graph) it runs exactly ``max_iter`` iterations with
converged slices frozen (the same result as stopping early; no warning, no host read).
:func:`chunked` runs it over cache-sized row blocks on CPU.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnopt._validation import host_readable
from attnopt.functional.regularized._common import shift, warn_not_converged

__all__ = ["chunked", "entmax_search"]


def _qlog_base(u: Tensor, eps: Tensor) -> Tensor:
    """``log p = log1p(ε u)/ε`` with ``ε u`` clamped at ``−1`` (``p = 0`` there); ``ε ≠ 0``."""
    return torch.log1p((eps * u).clamp_min(-1.0)).div_(eps)


def entmax_search(
    x: Tensor, alpha: Tensor, dim: int, tol: float, max_iter: int,
    theta0: Tensor | None = None, warn: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Every ``α > 0`` (tensor ``α`` broadcast, size 1 along ``dim``): safeguarded Newton.

    In score units, ``p_j = [1 + ε(x_j − m − τ)]₊^{1/ε}`` with ``ε = α − 1`` (the Tsallis
    ``q``-exponential: ``ε → 0`` is ``exp``), computed as ``exp(log1p(ε u)/ε)`` — accurate for
    ``α`` near 1, where the power form ``t^{1/ε}`` loses ``1/ε`` digits. Newton runs on
    ``g(τ) = S(τ)^ε − 1`` (``S = Σ p``): convex decreasing for ``0 < ε ≤ 1``, concave increasing
    for ``ε < 0``, so from ``τ = 0`` (``S ≥ 1``) the iterates rise monotonically to the root; the
    step ``S·(1 − S^{−ε})/(ε Σ p^{1−ε})`` is exact for softmax (``ε → 0``). A bracket
    ``[0, (1 − n^{−ε})/ε]`` guards ``α > 2``. Rows with ``α = 1`` are replaced by softmax.

    Returns ``(p, θ)`` with ``θ = ετ − 1`` (the threshold of ``[(α−1)(x − m) − θ]₊``).
    """
    xs, empty = shift(x, dim)
    am1 = (alpha - 1).to(xs.dtype)
    tiny = torch.finfo(xs.dtype).tiny
    eps_f = torch.finfo(xs.dtype).eps
    e = torch.where(am1 == 0, torch.full_like(am1, 1e-20 if xs.dtype == torch.float64 else 1e-12), am1)
    n = x.shape[dim]
    shape = list(xs.shape)
    shape[dim] = 1
    e = e.expand(shape)
    lo = torch.zeros(shape, dtype=xs.dtype, device=xs.device)
    hi = -torch.expm1(-e * math.log(n)) / e
    tau = lo.clone() if theta0 is None else ((theta0 + 1) / e).clamp(min=lo, max=hi)
    on_host = host_readable(xs)  # else a fixed max_iter count: converged slices stay frozen below
    big = bool((am1 >= 1).any()) if on_host else True  # p^{1-ε} infinite (or 0·inf) at p = 0: mask it
    for _ in range(max_iter):
        q = _qlog_base(xs - tau, e)
        p = torch.exp(q)
        total = p.sum(dim=dim, keepdim=True)
        w = torch.exp(q.mul_(1 - e))
        if big:
            w = torch.where(p > 0, w, 0.0)
        deriv = w.sum(dim=dim, keepdim=True)
        dev = torch.where(empty, torch.zeros_like(total), total - 1)
        done = (dev.abs() <= tol) | (hi - lo <= 4 * eps_f * (1 + hi.abs()))
        if on_host and bool(done.all()):
            break
        lo = torch.where(dev > 0, tau, lo)
        hi = torch.where(dev > 0, hi, tau)
        logs = total.clamp_min(tiny).log()
        step = total * (-torch.expm1(-e * logs)) / e / deriv.clamp_min(tiny)
        new = tau + step
        bad = ~((new > lo) & (new < hi)) | ~torch.isfinite(new)
        new = torch.where(bad, 0.5 * (lo + hi), new)
        tau = torch.where(done, tau, new)
    else:
        if not warn:  # a capped run for a lower bound: lo (where Σp ≥ 1) is one
            return xs, e * lo - 1
        if on_host:  # (off the host no warning: it would read a value)
            warn_not_converged("entmax", max_iter, float(dev.abs().max()))
    p = torch.exp(_qlog_base(xs - tau, e))
    p = p.div_(p.sum(dim=dim, keepdim=True).clamp_min(tiny))
    if not on_host or bool((am1 == 0).any()):
        p = torch.where(am1 == 0, torch.softmax(xs.masked_fill(empty, 0.0), dim=dim), p)
    return p.masked_fill_(empty, 0.0), e * tau - 1


def chunked(
    core: Callable[[Tensor, int], tuple[Tensor, Tensor]], x: Tensor, dim: int, elements: int
) -> tuple[Tensor, Tensor]:
    """Run ``core`` over blocks of rows that fit in cache (last-dim, contiguous inputs only).

    The threshold search passes over its rows several times; on blocks of ~``elements``
    entries those passes hit the CPU cache instead of memory (2-3x faster on large inputs).
    """
    n = x.shape[-1] if x.dim() else 1
    if x.device.type != "cpu" or dim != x.dim() - 1 or x.dim() < 2 or not x.is_contiguous() \
            or x.numel() <= 2 * elements:
        return core(x, dim)
    flat = x.view(-1, n)
    rows = max(1, elements // n)
    out = torch.empty_like(flat)
    theta = torch.empty((flat.shape[0], 1), dtype=x.dtype, device=x.device)
    for i in range(0, flat.shape[0], rows):
        out[i : i + rows], theta[i : i + rows] = core(flat[i : i + rows], -1)
    return out.view(x.shape), theta.view(*x.shape[:-1], 1)

