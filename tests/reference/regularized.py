"""Slow, obvious float64 oracles for the regularized maps (sort-based and bisection)."""
from __future__ import annotations

import torch
from torch import Tensor


def sparsemax_sort(x: Tensor, dim: int = -1) -> Tensor:
    """Sort-based sparsemax (Martins & Astudillo, 2016) in float64; -inf gets 0, all -inf -> 0."""
    x = x.to(torch.float64).movedim(dim, -1)
    out = torch.zeros_like(x)
    for idx in range(x.reshape(-1, x.shape[-1]).shape[0]):
        row = x.reshape(-1, x.shape[-1])[idx]
        fin = torch.isfinite(row)
        if not fin.any():
            continue
        z = row[fin]
        zs, _ = torch.sort(z, descending=True)
        cs = torch.cumsum(zs, 0)
        ks = torch.arange(1, len(zs) + 1, dtype=torch.float64)
        k = int((1 + ks * zs > cs).nonzero().max()) + 1
        tau = (cs[k - 1] - 1) / k
        r = torch.zeros_like(row)
        r[fin] = torch.clamp(z - tau, min=0)
        out.reshape(-1, x.shape[-1])[idx] = r
    return out.movedim(-1, dim)


def entmax15_sort(x: Tensor, dim: int = -1) -> Tensor:
    """Sort-based 1.5-entmax (Peters et al., 2019, Alg. 2) in float64, row by row; -inf gets 0.

    With ``z = (x − max x)/2`` sorted decreasingly, ``τ_k = μ_k − √((1 − k(μ²_k − μ_k²))/k)``
    (``μ_k``, ``μ²_k``: means of the top ``k`` values and of their squares); the support size
    is the number of ``k`` with ``τ_k ≤ z_(k)`` and ``p = [z − τ]₊²``.
    """
    x = x.to(torch.float64).movedim(dim, -1)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for idx in range(flat.shape[0]):
        row = flat[idx]
        fin = torch.isfinite(row)
        if not fin.any():
            continue
        z = (row[fin] - row[fin].max()) / 2
        zs, _ = torch.sort(z, descending=True)
        ks = torch.arange(1, len(zs) + 1, dtype=torch.float64)
        mean = torch.cumsum(zs, 0) / ks
        mean_sq = torch.cumsum(zs * zs, 0) / ks
        tau = mean - torch.sqrt(torch.clamp((1 - ks * (mean_sq - mean * mean)) / ks, min=0))
        k = int((tau <= zs).sum())
        out[idx, fin] = torch.clamp(z - tau[k - 1], min=0) ** 2
    return out.reshape(x.shape).movedim(-1, dim)


def entmax_bisect_ref(x: Tensor, alpha: float, dim: int = -1, n_iter: int = 200) -> Tensor:
    """α-entmax by plain bisection on the threshold in float64 (200 halvings)."""
    x = x.to(torch.float64).movedim(dim, -1)
    empty = torch.isneginf(x).all(-1, keepdim=True)
    m = torch.where(empty, torch.zeros_like(x[..., :1]), x.amax(-1, keepdim=True))
    z = (x - m) * (alpha - 1)
    lo = torch.full_like(m, -1.0)
    hi = torch.zeros_like(m)
    for _ in range(n_iter):
        mid = (lo + hi) / 2
        total = torch.clamp(z - mid, min=0).pow(1 / (alpha - 1)).sum(-1, keepdim=True)
        lo = torch.where(total >= 1, mid, lo)
        hi = torch.where(total >= 1, hi, mid)
    p = torch.clamp(z - lo, min=0).pow(1 / (alpha - 1))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.where(empty, torch.zeros_like(p), p).movedim(-1, dim)


def sparsemax_support_size(x: Tensor) -> Tensor:
    """``k(z) = max{k : 1 + k z_(k) > Σ_{j≤k} z_(j)}`` along the last dim (finite rows)."""
    zs, _ = torch.sort(x.to(torch.float64), dim=-1, descending=True)
    cs = torch.cumsum(zs, -1)
    ks = torch.arange(1, x.shape[-1] + 1, dtype=torch.float64)
    return (1 + ks * zs > cs).to(torch.int64).cumprod(-1).sum(-1)


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, weights_fn, *, mask: Tensor | None = None, bias: Tensor | None = None,
    scale: float | None = None, causal: bool = False,
) -> Tensor:
    """Materialized float64 attention: ``weights_fn(qk*scale + bias + mask) @ v``."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias.to(torch.float64)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), float("-inf"))
    return weights_fn(s) @ v
