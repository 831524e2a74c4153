r"""Exact MEM / Fenchel-dual solver and its closed-form approximations (fenchel-dual-attention Sec. 4–6).

Glossary: templates ``t_1..t_n ∈ R^d`` (rows of ``T``), preference ``u_i ≥ 0`` (normalized
internally to ``ū``), ``μ = Σ ū_i t_i``, evidence ``z``, ``b = μ + z``, reliability ``α > 0``.

* Primal (3): :math:`\min_{p ∈ Δ} \tfrac{α}{2}\|b - \sum_i p_i t_i\|^2 + \mathrm{KL}(p\|ū)`.
* Dual (7): :math:`λ^* = \arg\max_λ \langle λ, b\rangle - \|λ\|^2/(2α)
  - \log\sum_i ū_i e^{\langle t_i, λ\rangle}`.
* Recovery (9)–(10): :math:`\tilde p_i ∝ ū_i e^{\langle t_i, λ^*\rangle}`,
  :math:`\hat h = \sum_i \tilde p_i t_i`.

**Batching convention.** ``templates (..., n, d)``, ``z (..., d)``, ``preference (..., n)``:
the leading dims broadcast like NumPy. To solve every query of a layer at once, give the
templates a size-1 query axis: ``templates = keys.unsqueeze(-3)`` ``(B, H, 1, n, d)`` with
``z = queries`` ``(B, H, Nq, d)`` and ``preference`` ``(B, H, Nq or 1, n)``; results are
``(B, H, Nq, ·)``. Templates are never copied per query: the solver works per template set.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from attnopt.dual._mem_batch import canonicalize, check_alpha, check_solver_knobs, safe_log, validate
from attnopt.dual._mem_core import apply_inverse_hessian, gram, newton_mem

__all__ = [
    "MEMSolution",
    "GaussianMEM",
    "solve_mem",
    "approx_lambda",
    "gaussian_mem",
    "mem_dual_objective",
    "mem_primal_objective",
]

Method = Literal["auto", "lowrank", "dense"]


@dataclass(frozen=True)
class MEMSolution:
    """Result of :func:`solve_mem` (all tensors detached; batch shape ``S``).

    Attributes:
        lam: (*S, d) the dual maximizer λ*.
        weights: (*S, n) the recovered primal optimum p̃ (eq. 9); 0 on excluded templates.
        h: (*S, d) the estimate ĥ = Σ p̃_i t_i (eq. 10).
        iterations: Newton iterations taken (the maximum over the batch).
        converged: ``True`` iff every problem reached ``grad_norm <= max(tol, floor)``.
        grad_norm: (*S,) ‖∇f(λ*)‖ = ‖b − λ*/α − ĥ‖ measured at the returned λ*.
    """

    lam: Tensor
    weights: Tensor
    h: Tensor
    iterations: int
    converged: bool
    grad_norm: Tensor


@dataclass(frozen=True)
class GaussianMEM:
    """Closed form of Sec. 5: ``lam`` = λ* and ``h`` = ĥ, both shaped like ``broadcast(mu, b)``."""

    lam: Tensor
    h: Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _resolve_method(method: Method, n: int, d: int) -> bool:
    if method not in ("auto", "lowrank", "dense"):
        raise ValueError(f"method must be 'auto', 'lowrank' or 'dense', got {method!r}")
    return n < d if method == "auto" else method == "lowrank"


def solve_mem(
    templates: Tensor,
    z: Tensor,
    *,
    preference: Tensor | None = None,
    alpha: float = 1.0,
    tol: float = 1e-8,
    max_iter: int = 50,
    method: Method = "auto",
) -> MEMSolution:
    r"""Solve the MEM problem exactly through its Fenchel dual (fenchel-dual-attention eq. 7, 9–10).

    .. math:: λ^* = \arg\max_λ\ \langle λ, μ + z\rangle - \frac{\|λ\|^2}{2α}
              - \log \sum_i ū_i e^{\langle t_i, λ\rangle}, \qquad
              \tilde p_i ∝ ū_i e^{\langle t_i, λ^*\rangle}, \quad \hat h = \sum_i \tilde p_i t_i

    Damped Newton with analytic gradient ``μ + z − λ/α − E_p[t]`` and Hessian
    ``−I/α − Cov_p[t]``, started from the second-order approximation (13) and globalized by
    a backtracking (Armijo) line search on the dual objective. The dual is ``1/α``-strongly
    concave, so this converges from any start, quadratically near λ*. With ``n < d`` the
    Newton system is solved in its ``n × n`` (Woodbury / low-rank) form, else as ``d × d``.
    Runs without autograd (see :func:`attnopt.dual.mem_attention` for gradients).

    Args:
        templates: (..., n, d) templates t_i.
        z: (..., d) evidence.
        preference: (..., n) u ≥ 0, normalized internally; 0 excludes a template; default
            uniform. Leading dims of the three inputs broadcast (see the module docstring for
            solving all queries of a layer without copying templates).
        alpha: reliability α > 0.
        tol: stop when ‖∇f‖₂ ≤ tol for every problem. The tolerance is floored at
            ``64·eps·(1 + ‖μ+z‖ + maxᵢ‖tᵢ‖)`` (what the dtype can resolve: ~1e-13 in float64,
            ~1e-5 in float32 for unit-scale data).
        max_iter: maximum number of Newton iterations (≥ 1).
        method: ``"auto"`` (low-rank when n < d), ``"lowrank"`` or ``"dense"``.

    Returns:
        :class:`MEMSolution` in the input dtype (float16/bfloat16 are solved in float32).

    Raises:
        ValueError: ``alpha <= 0``, ``tol <= 0``, ``max_iter < 1``, mismatched or
            non-broadcasting shapes, non-finite inputs, a negative preference or a
            preference row that is all zero, unknown ``method``.
        TypeError: non-tensor or non-floating inputs; ``z`` of another dtype.

    Warns:
        RuntimeWarning: some problem did not reach the tolerance (``converged=False``).
    """
    alpha = check_alpha(alpha)
    check_solver_knobs(tol, max_iter)
    batch = validate(templates, z, preference)
    lowrank = _resolve_method(method, *templates.shape[-2:])
    dtype = templates.dtype
    cdt = _compute_dtype(dtype)
    with torch.no_grad():
        logu = None if preference is None else safe_log(preference.detach().to(cdt))
        cb = canonicalize(templates.detach().to(cdt), z.detach().to(cdt), logu, batch)
        lam, w, iterations, gnorm, tol_eff = newton_mem(
            cb.T, cb.z, cb.logu, alpha, float(tol), max_iter, lowrank
        )
        h = w @ cb.T
        converged = bool((gnorm <= tol_eff).all())
    if not converged:
        worst = float(gnorm.max())
        warnings.warn(
            f"solve_mem did not converge in {max_iter} Newton iterations: max grad norm {worst:.3e} "
            f"> tol {tol:.1e} (see MEMSolution.grad_norm)",
            RuntimeWarning,
            stacklevel=2,
        )
    return MEMSolution(
        lam=cb.restore(lam).to(dtype),
        weights=cb.restore(w).to(dtype),
        h=cb.restore(h).to(dtype),
        iterations=iterations,
        converged=converged,
        grad_norm=cb.restore(gnorm.unsqueeze(-1)).squeeze(-1).to(dtype),
    )


def approx_lambda(
    templates: Tensor,
    z: Tensor,
    *,
    preference: Tensor | None = None,
    alpha: float = 1.0,
    order: int = 1,
) -> Tensor:
    r"""Closed-form approximations of λ* (fenchel-dual-attention eq. 14 and eq. 13).

    .. math:: \text{order 1 (14)}:\ λ ≈ α z, \qquad
              \text{order 2 (13)}:\ λ ≈ α (I + αΣ)^{-1} z,\quad Σ = \mathrm{Cov}_{ū}[t]

    Order 1 error is O(α²), order 2 O(α³) as α → 0 (second-order cumulant expansion).
    Differentiable by ordinary autograd.

    Args:
        templates, z, preference: as :func:`solve_mem`.
        alpha: α > 0.
        order: 1 or 2.
    Returns:
        (*S, d) approximate λ* (batch shape ``S`` as in :func:`solve_mem`).
    Raises:
        ValueError: ``order`` not in {1, 2}, and the input errors of :func:`solve_mem`.
    """
    alpha = check_alpha(alpha)
    if order not in (1, 2) or isinstance(order, bool):
        raise ValueError(f"order must be 1 or 2, got {order!r}")
    batch = validate(templates, z, preference)
    if order == 1:
        return (alpha * z).expand(*batch, z.shape[-1]).clone()
    dtype = templates.dtype
    cdt = _compute_dtype(dtype)
    n, d = templates.shape[-2:]
    logu = None if preference is None else safe_log(preference.to(cdt))
    cb = canonicalize(templates.to(cdt), z.to(cdt), logu, batch)
    lowrank = n < d
    u_bar = torch.softmax(cb.logu, dim=-1)
    lam = apply_inverse_hessian(cb.T, gram(cb.T) if lowrank else None, u_bar, alpha, cb.z, lowrank)
    return cb.restore(lam).to(dtype)


def gaussian_mem(mu: Tensor, b: Tensor, alpha: float) -> GaussianMEM:
    r"""Exact MEM solution for a Gaussian preference ``u = N(μ, I)`` (fenchel-dual-attention Sec. 5).

    .. math:: λ^* = \frac{α}{1+α}(b - μ), \qquad \hat h = \frac{μ + α b}{1 + α}, \qquad b = μ + z

    Exact for every α > 0 (the cumulant expansion (12) stops at second order).

    Args:
        mu: (..., d) mean of the Gaussian preference.
        b: (..., d) the noisy observation ``μ + z``.
        alpha: α > 0.
    Returns:
        :class:`GaussianMEM` with ``lam`` and ``h`` of shape ``broadcast(mu, b)``.
    Raises:
        ValueError: ``alpha <= 0`` or shapes that do not broadcast. TypeError: non-tensors.
    """
    alpha = check_alpha(alpha)
    if not isinstance(mu, Tensor) or not isinstance(b, Tensor):
        raise TypeError("mu and b must be torch.Tensors")
    try:
        torch.broadcast_shapes(mu.shape, b.shape)
    except RuntimeError as exc:
        raise ValueError(f"mu {tuple(mu.shape)} and b {tuple(b.shape)} do not broadcast") from exc
    return GaussianMEM(lam=alpha / (1 + alpha) * (b - mu), h=(mu + alpha * b) / (1 + alpha))


def _normalized(preference: Tensor | None, templates: Tensor) -> Tensor:
    if preference is None:
        n = templates.shape[-2]
        return torch.full(templates.shape[:-1], 1.0 / n, dtype=templates.dtype, device=templates.device)
    return preference / preference.sum(-1, keepdim=True)


def mem_dual_objective(
    lam: Tensor, templates: Tensor, z: Tensor, *, preference: Tensor | None = None, alpha: float = 1.0
) -> Tensor:
    r"""Dual objective (7): ``<λ, μ+z> − ‖λ‖²/(2α) − log Σ ū_i exp<t_i, λ>``, shape (*S,)."""
    alpha = check_alpha(alpha)
    u = _normalized(preference, templates)
    b = (u.unsqueeze(-2) @ templates).squeeze(-2) + z
    s = (templates @ lam.unsqueeze(-1)).squeeze(-1) + safe_log(u)
    return (lam * b).sum(-1) - (lam * lam).sum(-1) / (2 * alpha) - torch.logsumexp(s, dim=-1)


def mem_primal_objective(
    weights: Tensor, templates: Tensor, z: Tensor, *, preference: Tensor | None = None, alpha: float = 1.0
) -> Tensor:
    r"""Primal objective (3): ``α/2 ‖μ + z − Σ p_i t_i‖² + KL(p‖ū)``, shape (*S,)."""
    alpha = check_alpha(alpha)
    u = _normalized(preference, templates)
    b = (u.unsqueeze(-2) @ templates).squeeze(-2) + z
    h = (weights.unsqueeze(-2) @ templates).squeeze(-2)
    pos = weights > 0
    safe_p = torch.where(pos, weights, torch.ones_like(weights))
    safe_u = torch.where(pos, u.expand_as(weights), torch.ones_like(weights))
    kl = torch.where(pos, weights * (safe_p.log() - safe_u.log()), torch.zeros_like(weights)).sum(-1)
    return alpha / 2 * ((b - h) ** 2).sum(-1) + kl
