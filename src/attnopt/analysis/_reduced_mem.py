r"""Batched Newton solver for the MEM dual with templates shared across a batch (internal).

Solves, for every problem in a batch,

.. math:: \omega^* = \arg\max_\omega f(\omega) = \langle \omega, b\rangle - \frac{\|\omega\|^2}{2\alpha}
          - \log \sum_i \pi_i \exp\langle s_i, \omega\rangle

(fenchel-dual-attention eq. 7, ``b = μ + z``), where the templates ``s (B, n, r)`` are shared
by every head and query of a sentence: the second moments ``Σ_i p_i s_i s_iᵀ`` are one GEMM
against the precomputed outer products, never a per-problem copy of the templates.

The method is Newton with a frozen Hessian (chord / Shamanskii): the Hessian
``-(I/α + Cov_p[s])`` is factored at the start and re-factored only when the gradient stops
shrinking fast, and every step is safeguarded by backtracking on ``f``. Starting from
``ω = 0`` (the first-order solution ``λ ≈ αz``) this needs one or two factorizations.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = ["newton_mem_shared"]


def _state(omega: Tensor, b: Tensor, s: Tensor, log_pi: Tensor, alpha: float) -> tuple[Tensor, ...]:
    """Objective, gradient, probabilities and mean at ``omega``."""
    logits = log_pi + torch.matmul(omega, s.transpose(-2, -1))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - lse)
    mean = torch.matmul(p, s)
    f = (omega * b).sum(-1) - (omega * omega).sum(-1) / (2 * alpha) - lse.squeeze(-1)
    grad = b - omega / alpha - mean
    return f, grad, p, mean


def _factor(p: Tensor, mean: Tensor, outer: Tensor, alpha: float) -> Tensor:
    """Cholesky factor of ``I/α + Cov_p[s]`` (positive definite)."""
    r = mean.shape[-1]
    second = torch.matmul(p, outer).unflatten(-1, (r, r))
    hess = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    hess.diagonal(dim1=-2, dim2=-1).add_(1.0 / alpha)
    chol, info = torch.linalg.cholesky_ex(hess)
    if bool((info != 0).any()):  # numerically indefinite covariance: regularize slightly
        hess.diagonal(dim1=-2, dim2=-1).add_(1e-10 / alpha)
        chol = torch.linalg.cholesky(hess)
    return chol


def newton_mem_shared(
    s: Tensor, b: Tensor, log_pi: Tensor, *, alpha: float = 1.0, tol: float = 1e-8, max_iter: int = 50
) -> tuple[Tensor, int, bool, Tensor]:
    """Maximize the dual (eq. 7) for every head and query, templates shared per sentence.

    Args:
        s: (B, n, r) templates.
        b: (B, H, Q, r) the linear term ``μ + z``.
        log_pi: (B, H, Q, n) log preference (``-inf`` = excluded; each row needs one finite entry).
        alpha: reliability ``α > 0``.
        tol: stop when every gradient norm is at most ``tol · (1 + ‖b‖)``.
        max_iter: steps at most.

    Returns:
        ``(omega (B, H, Q, r), steps, converged, grad_norm (B, H, Q))``; warns with a
        ``RuntimeWarning`` when it did not converge.
    """
    s4 = s.unsqueeze(1)
    outer = (s.unsqueeze(-1) * s.unsqueeze(-2)).flatten(-2).unsqueeze(1)
    omega = torch.zeros_like(b)
    f, grad, p, mean = _state(omega, b, s4, log_pi, alpha)
    chol = _factor(p, mean, outer, alpha)
    gnorm = grad.norm(dim=-1)
    limit = tol * (1.0 + b.norm(dim=-1))
    it = 0
    while it < max_iter and bool((gnorm > limit).any()):
        it += 1
        step = torch.cholesky_solve(grad.unsqueeze(-1), chol).squeeze(-1)
        t = torch.ones_like(f)
        for _ in range(40):  # backtracking: f must not decrease
            cand = omega + t.unsqueeze(-1) * step
            f_new, g_new, p_new, m_new = _state(cand, b, s4, log_pi, alpha)
            ok = f_new >= f - 1e-13 * f.abs()
            if bool(ok.all()):
                break
            t = torch.where(ok, t, t / 2)
        new_norm = g_new.norm(dim=-1)
        slow = bool((new_norm > 0.25 * gnorm)[new_norm > limit].any())
        omega, f, grad, gnorm = cand, f_new, g_new, new_norm
        if slow:
            chol = _factor(p_new, m_new, outer, alpha)
    converged = bool((gnorm <= limit).all())
    if not converged:
        warnings.warn(
            f"MEM dual Newton did not converge in {max_iter} iterations "
            f"(max relative gradient norm {float((gnorm / (1.0 + b.norm(dim=-1))).max()):.3e} "
            f"> tol {tol:.1e})",
            RuntimeWarning,
            stacklevel=2,
        )
    return omega, it, converged, gnorm
