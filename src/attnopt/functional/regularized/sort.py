r"""Sparsemax and 1.5-entmax by sorting: exact thresholds with a fixed op count (the reference leaf).

The reference of both maps (any device) and the path wherever the C kernels of :mod:`.cpu` do
not run: a GPU, meta / fake tensors, a compiled graph without the C library, ``dim`` not last,
``backend("reference")``, rows the C search did not settle. A threshold search stops when a value
read on the host says so (the support stopped changing, ``|Σp − 1| ≤ tol``), which stalls a GPU
stream once per iteration and breaks a ``torch.compile`` graph; the sort-based algorithms find
the same thresholds in closed form with no data-dependent control flow (Martins & Astudillo
2016 for sparsemax; Peters, Niculae & Martins 2019, Alg. 2, for 1.5-entmax), so they run as one
fixed sequence of ops on any device. ``O(n log n)`` per row instead of a few ``O(n)`` sweeps:
CPU rows along the last dim take the C kernels.

With the row sorted decreasingly, ``z_(1) ≥ … ≥ z_(n)`` (``z = x − max x``, ``−inf`` last):

* sparsemax: the support size is ``k* = max{k : 1 + k z_(k) > Σ_{i≤k} z_(i)}`` and
  ``θ = (Σ_{i≤k*} z_(i) − 1)/k*``; ``p = [z − θ]₊``.
* 1.5-entmax (in map units ``z/2``): ``τ_k = μ_k − √((1 − k σ²_k)/k)₊`` with ``μ_k``, ``σ²_k``
  the mean and variance of the ``k`` largest; ``k* = #{k : τ_k ≤ z_(k)}`` and
  ``p = [z/2 − τ_{k*}]₊²`` (renormalized, as the search path does).

A slice that is entirely ``−inf`` gives zeros. Entries at ``−inf`` make the tail of the
cumulative sums ``−inf`` / NaN; the support tests are false there, so they never count.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sparsemax_sort", "entmax15_sort"]


def _ranks(z: Tensor, dim: int) -> Tensor:
    """``1, 2, …, n`` along ``dim``, shaped to broadcast against ``z``."""
    n = z.shape[dim]
    shape = [1] * z.dim()
    shape[dim] = n
    return torch.arange(1, n + 1, dtype=z.dtype, device=z.device).view(shape)


def sparsemax_sort(z: Tensor, empty: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(p, θ)`` of sparsemax for shifted scores ``z`` (max 0 per slice; ``empty``: all ``−inf``)."""
    zs = torch.sort(z, dim=dim, descending=True).values
    cum = zs.cumsum(dim)
    k = _ranks(z, dim)
    support = (1.0 + k * zs) > cum  # true on a prefix: the support in sorted order
    kz = support.sum(dim=dim, keepdim=True).clamp_min(1)
    theta = (cum.gather(dim, kz - 1) - 1.0) / kz.to(z.dtype)
    theta = torch.where(empty, torch.zeros_like(theta), theta)
    p = (z - theta).clamp_min(0.0)
    return p.masked_fill(empty, 0.0), theta


def entmax15_sort(z: Tensor, empty: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(p, θ)`` of 1.5-entmax for shifted scores ``z`` (map units: ``p = [z/2 − θ]₊²``)."""
    x = z * 0.5
    xs = torch.sort(x, dim=dim, descending=True).values
    k = _ranks(x, dim)
    finite = torch.isfinite(xs)
    x0 = torch.where(finite, xs, torch.zeros_like(xs))  # −inf tail: no NaN from inf − inf below
    mean = x0.cumsum(dim) / k
    mean_sq = (x0 * x0).cumsum(dim) / k
    ss = k * (mean_sq - mean * mean)
    delta = ((1.0 - ss) / k).clamp_min(0.0)
    tau = mean - delta.sqrt()
    support = (tau <= xs) & finite
    kz = support.sum(dim=dim, keepdim=True).clamp_min(1)
    theta = tau.gather(dim, kz - 1)
    theta = torch.where(empty, torch.zeros_like(theta), theta)
    p = (x - theta).clamp_min(0.0).square()
    p = p / p.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return p.masked_fill(empty, 0.0), theta
