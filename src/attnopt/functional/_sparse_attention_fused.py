r"""Fused materialized sparsemax / α-entmax attention for short sequences (internal).

sdpa-one-sided-eot Prop. 4.2–4.3. Scores ``S = (scale·Q)Kᵀ + M − β|i−j|`` are formed once and
shifted in place to ``z = (α−1)(S − max_j S)`` (``α = 2``: ``z = S − max``). The threshold
``θ_i`` of each row solves ``Σ_j [z_ij − θ_i]₊^{1/(α−1)} = 1`` and lies in ``[−1, 0)``, so
only the *candidates* ``z_ij > −1`` can be in the support — a handful per row for attention
scores. They are compacted into a small padded ``(rows, K)`` matrix (pad ``−2``, never in the
support), sorted, and the exact sort-based threshold is computed there:

* sparsemax: ``k* = #{k : 1 + k z_(k) > Σ_{l≤k} z_(l)}``, ``θ = (Σ_{l≤k*} z_(l) − 1)/k*``;
* 1.5-entmax: ``τ_k = m_k − sqrt(max(0, (1 − k(m2_k − m_k²))/k))`` with the prefix means
  ``m_k, m2_k`` of ``z, z²``; ``θ = τ_{k*}``, ``k* = #{k : τ_k ≤ z_(k)}`` (Peters et al. 2019).

When some row has more than :data:`MAX_CANDIDATES` candidates (near-uniform scores), and for
any other α, the dense safeguarded Newton search of :mod:`attnopt.functional.entmax` is
used instead (same map). Then ``P = [z − θ]₊^{1/(α−1)}`` (renormalized for α ≠ 2), ``O = P V``.

Backward saves ``P`` (no recomputation): ``dP = dO Vᵀ``, ``dS = g ⊙ (dP − Σ g dP / Σ g)``
with ``g = p^{2−α}`` (the support indicator for sparsemax), ``dQ = scale·dS K``,
``dK = dSᵀ (scale·Q)``, ``dV = Pᵀ dO``, ``dβ = −Σ dS ⊙ |i − j|``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt.functional.entmax import _default_tol, _entmax_backward, _threshold_map

__all__ = ["fused_sparse_attention", "MAX_CANDIDATES"]

#: Most candidates ``z > −1`` in a row for the compact sort-based threshold.
MAX_CANDIDATES = 64


def _distance(nq: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    pos = torch.arange(nq, device=device)[:, None] - torch.arange(nk, device=device)[None, :]
    return pos.abs().to(dtype)


def _scores(qs: Tensor, k: Tensor, mask: Tensor | None, beta: Tensor | None, causal: bool) -> Tensor:
    s = torch.matmul(qs, k.transpose(-2, -1))
    nq, nk = s.shape[-2], s.shape[-1]
    if mask is not None:
        s.add_(mask)
    if beta is not None:
        dist = _distance(nq, nk, beta.dtype, s.device)
        bias = beta * dist if beta.dim() == 0 else beta.view(-1, 1, 1) * dist
        s.sub_(bias.to(s.dtype))
    if causal:
        s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _compact_threshold(z: Tensor, alpha: float) -> Tensor | None:
    """Exact ``θ`` (rows, 1) from the candidates ``z > −1`` of ``z (rows, N)``; ``None`` if too many."""
    cand = z > -1.0
    cnt = cand.sum(-1)
    kmax = int(cnt.max()) if cnt.numel() else 0
    if kmax > MAX_CANDIDATES:
        return None
    rows = z.shape[0]
    kmax = max(kmax, 1)
    idx = cand.nonzero()
    r = idx[:, 0]
    starts = torch.cumsum(cnt, 0) - cnt
    pos = torch.arange(r.shape[0], device=z.device) - starts[r]
    pad = torch.full((rows, kmax), -2.0, dtype=z.dtype, device=z.device)
    pad[r, pos] = z[cand]
    zs = pad.sort(-1, descending=True).values
    rho = torch.arange(1, kmax + 1, dtype=z.dtype, device=z.device)
    cs = zs.cumsum(-1)
    if alpha == 2.0:
        ksup = ((1 + rho * zs) > cs).sum(-1, keepdim=True).clamp_min(1)
        theta = (cs.gather(-1, ksup - 1) - 1) / ksup
    else:
        mean = cs / rho
        mean_sq = (zs * zs).cumsum(-1) / rho
        delta = ((1 - rho * (mean_sq - mean * mean)) / rho).clamp_min(0)
        tau = mean - delta.sqrt()
        ksup = (tau <= zs).sum(-1, keepdim=True).clamp_min(1)
        theta = tau.gather(-1, ksup - 1)
    return torch.where((cnt > 0)[:, None], theta, torch.zeros_like(theta))


def _sparse_map(s: Tensor, alpha: float) -> Tensor:
    """``P`` from the scores ``s (…, Nq, Nk)`` (``s`` is overwritten)."""
    nk = s.shape[-1]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # a row with no admissible key: P = 0
    z = s.sub_(m)
    if alpha in (1.5, 2.0):
        if alpha == 1.5:
            z.mul_(0.5)
        theta = _compact_threshold(z.reshape(-1, nk), alpha)
        if theta is not None:
            p = z.sub_(theta.view(*z.shape[:-1], 1)).relu_()
            if alpha == 1.5:
                p.square_()
                p.div_(p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny))
            return p
        if alpha == 1.5:
            z.mul_(2.0)
    max_iter = 1000 if alpha == 2.0 else 100
    return _threshold_map(z, alpha, -1, max_iter, _default_tol(z.dtype))[0]


class _FusedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, beta: Tensor | None, alpha: float,
        scale: float, causal: bool,
    ) -> Tensor:
        qs = q * scale
        b = beta.detach() if beta is not None else None
        p = _sparse_map(_scores(qs, k, mask, b, causal), alpha)
        ctx.alpha, ctx.scale = alpha, scale
        ctx.save_for_backward(qs, k, v, p, beta)
        return torch.matmul(p, v)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qs, k, v, p, beta = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        dv = torch.matmul(p.transpose(-2, -1), dout)
        ds = _entmax_backward(p, torch.matmul(dout, v.transpose(-2, -1)), ctx.alpha, -1)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), qs)
        dbeta = None
        if beta is not None and ctx.needs_input_grad[4]:
            dist = _distance(p.shape[-2], p.shape[-1], ds.dtype, ds.device)
            per = -(ds * dist).sum((-2, -1))
            dbeta = per.sum() if beta.dim() == 0 else per.reshape(-1, beta.shape[0]).sum(0)
            dbeta = dbeta.to(beta.dtype)
        return dq, dk, dv, None, dbeta, None, None, None


def fused_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, alpha: float, scale: float, mask: Tensor | None, beta: Tensor | None,
    is_causal: bool,
) -> Tensor:
    """Sparsemax (``alpha = 2``) / α-entmax attention on materialized scores (inputs validated).

    Same contract as :func:`attnopt.functional._blocked_sparse.blocked_sparse_attention`.
    """
    orig = q.dtype
    compute = torch.float32 if orig in (torch.float16, torch.bfloat16) else orig
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    qkv = []
    for x in (q, k, v):
        x = x.to(compute)
        qkv.append(x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:]))
    m = None if mask is None else mask.detach().to(compute)
    out: Tensor = _FusedSparseAttention.apply(*qkv, m, beta, alpha, scale, is_causal)
    return out.to(orig)
