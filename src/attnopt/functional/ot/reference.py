r"""Optimal-transport attention in plain PyTorch: the formula of eq. (22) (any device).

fenchel-dual-attention Sec. 9, eq. (22): ``log p* = log E + log(K · (u / Z))`` with
``Z = E · K``, ``K_{a,i} = exp(−M(a, t_i)/γ)``, ``E_{k,a} = exp(α z_kᵀa/γ)``, evaluated as
stabilized log-domain matrix products (:func:`log_matmul_exp`), so memory is ``O((Nq + n)·m)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import host_readable
from attnopt.functional._softmax import safe_logsumexp
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["log_matmul_exp", "ot_log_weights"]


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def log_matmul_exp(x: Tensor, y: Tensor) -> Tensor:
    r"""``log(exp(x) @ exp(y))`` without overflow: :math:`\log\sum_k \exp(x_{ik} + y_{kj})`.

    Rows of ``x`` and columns of ``y`` are shifted by their (detached) maxima, multiplied
    with one BLAS matmul and shifted back. Entries whose shifted sum falls below
    ``sqrt(tiny)`` of the dtype (the two maxima sit at different ``k`` — e.g. a very small
    ``γ``) lose relative precision there; exactly those entries are recomputed by a direct
    log-sum-exp, so the result is accurate for every input (off the CPU and in a compiled graph,
    where the test cannot be read on the host, the direct log-sum-exp of every entry is formed,
    ``(..., p, q, r)`` at once, and selected where needed). ``-inf`` entries are allowed; a
    sum with no finite term is ``-inf`` (with zero, not NaN, gradients).

    Args:
        x: (..., p, q) log-values.
        y: (..., q, r) log-values; batch dims broadcast with ``x``.
    Returns:
        (..., p, r).
    """
    xm_raw = x.detach().amax(-1, keepdim=True)
    ym_raw = y.detach().amax(-2, keepdim=True)
    xm, ym = _finite_or_zero(xm_raw), _finite_or_zero(ym_raw)
    s = torch.matmul(torch.exp(x - xm), torch.exp(y - ym))
    thr = torch.finfo(s.dtype).tiny ** 0.5
    on_host = host_readable(s)
    if s.numel() == 0 or (on_host and bool(s.amin() >= thr)):  # the common case: no underflow anywhere
        return torch.log(s) + (xm + ym)
    ok = s >= thr
    out = torch.where(ok, torch.log(torch.where(ok, s, torch.ones_like(s))) + xm + ym, float("-inf"))
    if not on_host:  # no host read (a GPU, a compiled graph): the direct log-sum-exp, selected per entry
        direct = safe_logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), dim=-2)  # (..., p, q, r) at once
        return torch.where(ok, out, direct)
    need = ~ok & torch.isfinite(xm_raw) & torch.isfinite(ym_raw)
    if not bool(need.any()):
        return out
    batch = out.shape[:-2]
    xe = x.expand(*batch, *x.shape[-2:])
    yt = y.expand(*batch, *y.shape[-2:]).transpose(-2, -1)
    idx = need.nonzero(as_tuple=True)
    step = max(1, THRESHOLDS.ot_gather_elements // max(1, x.shape[-1]))
    vals = []
    for start in range(0, idx[0].numel(), step):
        sl = tuple(t[start : start + step] for t in idx)
        rows = xe[sl[:-1]]  # (chunk, q) via (*batch_idx, i)
        cols = yt[sl[:-2] + sl[-1:]]  # (chunk, q) via (*batch_idx, j)
        vals.append(safe_logsumexp(rows + cols, dim=-1))
    return out.index_put(idx, torch.cat(vals))


def _log_preference(u: Tensor) -> Tensor:
    pos = u > 0
    return torch.where(pos, torch.log(torch.where(pos, u, torch.ones_like(u))), float("-inf"))


def ot_log_weights(
    z: Tensor, bank: Tensor, u: Tensor, log_k: Tensor, alpha: float, gamma: float, bank_mask: Tensor | None
) -> Tensor:
    """``log p*`` of eq. (22), (..., Nq, m), from the log kernel ``log_k = -M/γ`` (..., m, n)."""
    scores = torch.matmul(z, bank.transpose(-2, -1)) * (alpha / gamma)  # log E, (..., Nq, m)
    if bank_mask is not None:
        scores = scores.masked_fill(~bank_mask.unsqueeze(-2), float("-inf"))
    log_z = log_matmul_exp(scores, log_k)  # log Z_{k,i}, (..., Nq, n)
    if log_z.numel() == 0 or (host_readable(log_z) and bool(log_z.amin() > float("-inf"))):  # never +inf/NaN
        w = _log_preference(u).unsqueeze(-2) - log_z
    else:  # a template with no admissible bank member drops out
        finite = torch.isfinite(log_z)
        w = _log_preference(u).unsqueeze(-2) - torch.where(finite, log_z, torch.zeros_like(log_z))
        w = torch.where(finite, w, float("-inf"))
    return scores + log_matmul_exp(w, log_k.transpose(-2, -1))
