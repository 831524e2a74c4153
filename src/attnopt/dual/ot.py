r"""Exact OT-MEM solution: true preference (37)–(38) and the Fenchel dual (36) by Newton.

fenchel-dual-attention Sec. 9 / App. D. With the entropic OT distance ``W_γ(p, u; M)`` in
place of ``KL(p‖u)``, the MEM problem (31) is
``min_p α/2 ‖(μ̃ + z) − Σ_a p(a) a‖² + W_γ(p, u; M)``; its dual is

.. math:: \lambda^* = \arg\max_\lambda\ \langle \tilde\mu + z, \lambda\rangle
          - \frac{\|\lambda\|^2}{2\alpha}
          - \gamma \sum_i u_i \log \sum_{a\in A} \exp\Big(\frac{a^\top\lambda - M(a,t_i)}{\gamma}\Big)

with gradient ``μ̃ + z − λ/α − Σ_i u_i E_{q_i(λ)}[a]`` and Hessian
``−I/α − (1/γ) Σ_i u_i Cov_{q_i(λ)}[a]``, ``q_i(λ)(a) ∝ exp((aᵀλ − M(a,t_i))/γ)``; strongly
concave, so damped Newton converges in a few steps. ``p*(a) = Σ_i u_i q_i(λ*)(a)`` (35).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from attnopt.functional.ot.cost import (
    CostSpec,
    check_ot_inputs,
    check_positive,
    log_kernel,
    normalized_preference,
)

__all__ = ["OTMEMSolution", "true_preference", "solve_ot_mem"]


@dataclass(frozen=True)
class OTMEMSolution:
    """Result of :func:`solve_ot_mem` (tensors in the dtype of ``z``).

    Attributes:
        lam: (..., Nq, d) the dual maximizer ``λ*``.
        weights: (..., Nq, m) ``p*`` over the bank by eq. (35).
        output: (..., Nq, d) ``ĥ = Σ_a p*(a) a`` (equals ``μ̃ + z − λ*/α`` at the optimum).
        u_tilde: (..., m) the true preference ``ũ`` (37).
        mu_tilde: (..., d) its mean ``μ̃`` (38).
        objective: (..., Nq) the dual objective (36) at ``λ*``.
        grad_norm: largest gradient norm over the batch at the end.
        iterations: Newton steps taken.
        converged: ``grad_norm <= tol`` for every query.
    """

    lam: Tensor
    weights: Tensor
    output: Tensor
    u_tilde: Tensor
    mu_tilde: Tensor
    objective: Tensor
    grad_norm: float
    iterations: int
    converged: bool


def _true_pref(log_k: Tensor, u: Tensor, bank: Tensor) -> tuple[Tensor, Tensor]:
    q = torch.softmax(log_k, dim=-2)  # column i: softmax_a(-M(a, t_i)/γ), (..., m, n)
    u_tilde = torch.matmul(q, u.unsqueeze(-1)).squeeze(-1)
    return u_tilde, torch.matmul(u_tilde.unsqueeze(-2), bank).squeeze(-2)


def true_preference(
    templates: Tensor,
    preference: Tensor | None = None,
    *,
    bank: Tensor | None = None,
    cost: CostSpec = "neg_dot",
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    r"""The true preference ``ũ = argmin_p W_γ(p, u; M)`` and its mean (eq. 37–38, Prop. 1).

    .. math:: \tilde u(a) = \sum_i u_i \frac{\exp(-M(a, t_i)/\gamma)}{\sum_{a'} \exp(-M(a', t_i)/\gamma)},
              \qquad \tilde\mu = \sum_a \tilde u(a)\, a

    ``ũ → u`` as ``γ → 0`` when ``M(t, t) < M(t', t)``.

    Args:
        templates: (..., n, d) templates holding the preference (the bank itself when
            ``bank`` is ``None``, i.e. ``u`` is given over ``A``).
        preference: ``u >= 0`` broadcastable to (..., n), normalized to sum 1; default uniform.
        bank: (..., m, d) the set ``A`` (default ``templates``).
        cost: as :func:`attnopt.ot_weights` (``"neg_dot"``, ``"sqeuclidean"``, callable, tensor).
        gamma: entropic strength ``γ > 0``.

    Returns:
        ``(u_tilde (..., m), mu_tilde (..., d))`` in the dtype of ``templates`` (float32 for half).

    Raises:
        TypeError, ValueError: as :func:`attnopt.ot_weights`.
    """
    bank_t, batch = check_ot_inputs(None, templates, bank)
    gamma = check_positive("gamma", gamma)
    dtype = torch.float32 if templates.dtype in (torch.float16, torch.bfloat16) else templates.dtype
    u = normalized_preference(preference, batch, templates.shape[-2], dtype, templates.device)
    log_k = log_kernel(cost, bank_t, templates, gamma, square=bank is None, dtype=dtype, batch=batch)
    return _true_pref(log_k, u, bank_t.to(dtype))


def _evaluate(
    lam: Tensor, b: Tensor, bank: Tensor, log_k: Tensor, u: Tensor, alpha: float, gamma: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Objective (..., Nq), q (..., Nq, n, m), its log-normalizers and p (..., Nq, m)."""
    logits = (torch.matmul(lam, bank.transpose(-2, -1)) / gamma).unsqueeze(-2) + log_k.transpose(
        -2, -1
    ).unsqueeze(-3)
    lse = torch.logsumexp(logits, dim=-1)  # (..., Nq, n)
    q = torch.exp(logits - lse.unsqueeze(-1))
    p = torch.matmul(u.unsqueeze(-2).unsqueeze(-2), q).squeeze(-2)  # Σ_i u_i q_i, (..., Nq, m)
    obj = (b * lam).sum(-1) - (lam * lam).sum(-1) / (2 * alpha) - gamma * (lse * u.unsqueeze(-2)).sum(-1)
    return obj, q, lse, p


def _objective(
    lam: Tensor, b: Tensor, bank: Tensor, log_k: Tensor, u: Tensor, alpha: float, gamma: float
) -> Tensor:
    return _evaluate(lam, b, bank, log_k, u, alpha, gamma)[0]


def _derivatives(
    lam: Tensor, b: Tensor, bank: Tensor, log_k: Tensor, u: Tensor, alpha: float, gamma: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Objective (36), its analytic gradient, the negated Hessian (..., Nq, d, d) and p(λ) (35)."""
    obj, q, _, p = _evaluate(lam, b, bank, log_k, u, alpha, gamma)
    mus = torch.matmul(q, bank.unsqueeze(-3))  # E_{q_i}[a], (..., Nq, n, d)
    grad = b - lam / alpha - torch.matmul(p, bank)  # Σ_i u_i E_{q_i}[a] = E_p[a]
    # Σ_a p(a) a aᵀ − Σ_i u_i μ_i μ_iᵀ = Σ_i u_i Cov_{q_i}[a]
    second = torch.matmul(bank.transpose(-2, -1).unsqueeze(-3), p.unsqueeze(-1) * bank.unsqueeze(-3))
    mixed = torch.matmul(mus.transpose(-2, -1), u.unsqueeze(-2).unsqueeze(-1) * mus)
    eye = torch.eye(lam.shape[-1], dtype=lam.dtype, device=lam.device)
    return obj, grad, eye / alpha + (second - mixed) / gamma, p


def solve_ot_mem(
    z: Tensor,
    templates: Tensor,
    *,
    bank: Tensor | None = None,
    preference: Tensor | None = None,
    cost: CostSpec = "neg_dot",
    alpha: float = 1.0,
    gamma: float = 1.0,
    tol: float = 1e-9,
    max_iter: int = 50,
) -> OTMEMSolution:
    r"""Maximize the OT-MEM dual (36) by damped Newton; recover ``p*`` by (35).

    .. math:: \nabla = \tilde\mu + z - \lambda/\alpha - \sum_i u_i\, \mathbb E_{q_i(\lambda)}[a],\quad
              \nabla^2 = -I/\alpha - \tfrac1\gamma \sum_i u_i\, \mathrm{Cov}_{q_i(\lambda)}[a]

    Starts at ``λ = αz`` (the approximation behind eq. 22), takes Newton steps with Armijo
    backtracking, batched over every leading dim and query. Computed in float64; memory
    ``O(Nq·n·m)`` per iteration (an exact solver, not a layer).

    Args:
        z: (..., Nq, d) evidence.
        templates: (..., n, d) templates with preference ``u``.
        bank: (..., m, d) the set ``A`` (default ``templates``).
        preference: ``u >= 0`` broadcastable to (..., n), normalized; default uniform.
        cost: as :func:`attnopt.ot_weights`.
        alpha: reliability ``α > 0``.
        gamma: entropic strength ``γ > 0``.
        tol: stop when every gradient norm is ``<= tol``.
        max_iter: Newton steps at most.

    Returns:
        :class:`OTMEMSolution`. Warns ``RuntimeWarning`` when not converged.

    Raises:
        TypeError, ValueError: as :func:`attnopt.ot_weights`; ``tol <= 0``; ``max_iter < 1``.
    """
    bank_t, batch = check_ot_inputs(z, templates, bank)
    alpha = check_positive("alpha", alpha)
    gamma = check_positive("gamma", gamma)
    tol = check_positive("tol", tol)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be an int >= 1, got {max_iter!r}")
    f64 = torch.float64
    zd, bd = z.to(f64), bank_t.to(f64)
    u = normalized_preference(preference, batch, templates.shape[-2], f64, z.device)
    log_k = log_kernel(cost, bank_t, templates, gamma, square=bank is None, dtype=f64, batch=batch)
    u_tilde, mu_tilde = _true_pref(log_k, u, bd)
    b = mu_tilde.unsqueeze(-2) + zd
    u = u.expand(*batch, u.shape[-1])
    lam = (alpha * zd).expand(*batch, *zd.shape[-2:]).clone()
    iterations, grad_norm = 0, float("inf")
    for it in range(max_iter + 1):
        obj, grad, neg_hess, p = _derivatives(lam, b, bd, log_k, u, alpha, gamma)
        gnorm = grad.norm(dim=-1)
        grad_norm = float(gnorm.max()) if gnorm.numel() else 0.0
        if grad_norm <= tol or it == max_iter:
            break
        step = torch.linalg.solve(neg_hess, grad.unsqueeze(-1)).squeeze(-1)
        step = torch.where((gnorm > tol).unsqueeze(-1), step, torch.zeros_like(step))
        slope = (grad * step).sum(-1)
        t = torch.ones_like(obj)
        for _ in range(40):
            cand = _objective(lam + t.unsqueeze(-1) * step, b, bd, log_k, u, alpha, gamma)
            fine = cand >= obj + 1e-4 * t * slope - 1e-12 * (1 + obj.abs())
            if bool(fine.all()):
                break
            t = torch.where(fine, t, 0.5 * t)
        lam = lam + t.unsqueeze(-1) * step
        iterations = it + 1
    converged = grad_norm <= tol
    if not converged:
        warnings.warn(
            f"solve_ot_mem did not converge in {max_iter} Newton steps (max gradient norm "
            f"{grad_norm:.3e} > tol {tol:.1e})",
            RuntimeWarning,
            stacklevel=2,
        )
    out = torch.matmul(p, bd)
    dt = z.dtype
    return OTMEMSolution(
        lam=lam.to(dt),
        weights=p.to(dt),
        output=out.to(dt),
        u_tilde=u_tilde.to(dt),
        mu_tilde=mu_tilde.to(dt),
        objective=obj.to(dt),
        grad_norm=grad_norm,
        iterations=iterations,
        converged=converged,
    )
