r"""Generic solver of the regularized argmax over the simplex (sdpa-one-sided-eot §3–4).

.. math:: p^\star = \arg\max_{p \in \Delta} \langle s, p\rangle - \Omega(p)

for any convex, twice differentiable ``Ω`` given as a function — used to verify every closed
form (softmax, sparsemax, α-entmax, ALiBi) and to try new regularizers.

Method: a primal barrier (interior-point) method. For ``μ = 1, 10⁻¹, …`` down to
``≈ tol/100`` it minimizes ``Ω(p) − <s,p> − μ Σ_j log p_j`` subject to ``Σ_j p_j = 1`` by
equality-constrained Newton steps (gradient and Hessian of ``Ω`` by autograd, a fraction-to-
the-boundary rule and Armijo backtracking). Coordinates with ``s_j = −inf`` are fixed at 0.
The central path converges to the exact maximizer, including exact zeros of sparse maps
(the barrier solution has ``p_j = O(μ)`` there). Everything is computed in float64.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnopt._validation import check_tensor

__all__ = ["RegularizedSolution", "solve_regularized"]


@dataclass(frozen=True)
class RegularizedSolution:
    """Result of :func:`solve_regularized`.

    Attributes:
        weights: (..., S) the maximizer, in the dtype of the scores (computed in float64).
        iterations: total Newton steps over all barrier stages.
        converged: every slice reached ``kkt_residual <= tol`` on the last barrier stage.
        kkt_residual: ``max_j p_j (c_j − min_k c_k)`` with ``c = ∇Ω(p) − s`` (complementary
            slackness of the KKT conditions; 0 at the exact solution), maximized over slices.
        barrier: the final barrier weight ``μ``.
    """

    weights: Tensor
    iterations: int
    converged: bool
    kkt_residual: float
    barrier: float


def _omega_fn(regularizer: Any) -> Callable[[Tensor], Tensor]:
    value = getattr(regularizer, "value", None)
    if callable(value):
        return lambda p: value(p, -1)
    if callable(regularizer):
        return regularizer
    raise TypeError(
        "regularizer must be a callable omega(p) -> (...) or an object with value(p, dim), "
        f"got {type(regularizer).__name__}"
    )


def _grad_hess(omega: Callable[[Tensor], Tensor], p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``Ω(p)`` (...), its gradient (..., n) and Hessian (..., n, n) by autograd."""
    with torch.enable_grad():
        x = p.detach().requires_grad_(True)
        val = omega(x)
        if val.shape != p.shape[:-1]:
            raise ValueError(f"omega(p) must return shape {tuple(p.shape[:-1])}, got {tuple(val.shape)}")
        (g,) = torch.autograd.grad(val.sum(), x, create_graph=True)
        n = p.shape[-1]
        if not g.requires_grad:  # Ω linear in p
            hess = torch.zeros((*p.shape, n), dtype=p.dtype, device=p.device)
        else:
            basis = torch.eye(n, dtype=p.dtype, device=p.device).view(n, *([1] * (p.dim() - 1)), n)
            try:  # all Hessian columns in one vectorized backward
                (hb,) = torch.autograd.grad(
                    g, x, grad_outputs=basis.expand(n, *p.shape), retain_graph=True, is_grads_batched=True
                )
                hess = hb.movedim(0, -1)
            except RuntimeError:  # an op without a batching rule: one backward per column
                cols = []
                for j in range(n):
                    (h,) = torch.autograd.grad(g[..., j].sum(), x, retain_graph=True, allow_unused=True)
                    cols.append(torch.zeros_like(p) if h is None else h)
                hess = torch.stack(cols, dim=-1)
    return val.detach(), g.detach(), 0.5 * (hess + hess.transpose(-2, -1)).detach()


def _spd_solve(a: Tensor, b: Tensor) -> Tensor:
    """Solve ``a x = b`` for symmetric positive definite ``a`` (..., n, n).

    Small systems use a vectorized Gauss-Jordan sweep (no pivoting is needed for SPD
    matrices): batched LAPACK calls on tiny matrices are dominated by thread wake-ups.
    """
    n = a.shape[-1]
    if n > 64:
        return torch.linalg.solve_ex(a, b)[0]
    a, b = a.clone(), b.clone()
    for i in range(n):
        piv = a[..., i, i].unsqueeze(-1)
        row, rb = a[..., i, :] / piv, b[..., i, :] / piv
        factor = a[..., :, i].clone()
        factor[..., i] = 0
        a.sub_(factor[..., :, None] * row[..., None, :])
        b.sub_(factor[..., :, None] * rb[..., None, :])
        a[..., i, :] = row
        b[..., i, :] = rb
    return b


def _objective(omega: Callable[[Tensor], Tensor], p: Tensor, s: Tensor, active: Tensor, mu: float) -> Tensor:
    with torch.no_grad():
        logp = torch.where(active, p.clamp_min(1e-300).log(), torch.zeros_like(p))
        return omega(p) - (s * p).sum(-1) - mu * logp.sum(-1)


def solve_regularized(
    scores: Tensor,
    regularizer: Any,
    *,
    tol: float = 1e-9,
    max_iter: int = 500,
    dim: int = -1,
) -> RegularizedSolution:
    r"""Solve ``argmax_{p∈Δ} <s, p> − Ω(p)`` along ``dim`` for any convex differentiable ``Ω``.

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0 (an all ``-inf`` slice
            gives zeros). Keep ``S`` small (the Hessian is ``S × S`` per slice): this is the
            reference solver, not a fast path.
        regularizer: an object with ``value(p, dim) -> Ω(p)`` (:class:`~attnopt.functional.Shannon`,
            :class:`~attnopt.functional.SquaredL2`, :class:`~attnopt.functional.Tsallis`) or a
            callable ``omega(p) -> (...)`` taking the weights with the normalized dim last (the
            other dims in the order of ``scores``); it must be convex and twice differentiable
            on the interior of the simplex.
        tol: target KKT residual (see :class:`RegularizedSolution`).
        max_iter: maximum total Newton steps.
        dim: dimension that sums to one.
    Returns:
        :class:`RegularizedSolution`; warns (``RuntimeWarning``) if it did not converge.
    Raises:
        TypeError: non-floating ``scores``; a ``regularizer`` that is neither callable nor has
            ``value``.
        ValueError: NaN/``+inf`` scores; ``dim`` out of range; bad ``tol``/``max_iter``; an
            ``omega`` returning the wrong shape.
    """
    check_tensor("scores", scores)
    if not isinstance(dim, int) or not -scores.dim() <= dim < scores.dim():
        raise ValueError(f"dim={dim!r} is out of range for scores with {scores.dim()} dimensions")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if bool((torch.isnan(scores) | torch.isposinf(scores)).any()):
        raise ValueError("scores must not contain NaN or +inf (use -inf to mask an entry)")
    omega = _omega_fn(regularizer)
    s_full = scores.detach().to(torch.float64).movedim(dim, -1)
    active = torch.isfinite(s_full)
    n_active = active.sum(-1, keepdim=True)
    s = torch.where(active, s_full, torch.zeros_like(s_full))
    p = torch.where(active, 1.0 / n_active.clamp_min(1).to(s.dtype), torch.zeros_like(s))
    a = active.to(s.dtype)
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    pair = active.unsqueeze(-1) & active.unsqueeze(-2)
    mu_final = tol * 1e-2
    stages = max(1, math.ceil(-math.log10(mu_final)) + 1)
    iterations = 0
    mu = 1.0
    residual = float("inf")
    for stage in range(stages):
        mu = 10.0 ** (-stage)
        previous = float("inf")
        for _ in range(50):
            if iterations >= max_iter:
                break
            iterations += 1
            _, g, h = _grad_hess(omega, p)
            g = torch.where(active, g, torch.zeros_like(g))
            h = torch.where(pair, h, torch.zeros_like(h))
            pinv = torch.where(active, 1.0 / p.clamp_min(1e-300), torch.zeros_like(p))
            gb = g - s - mu * pinv * a
            hb = h + torch.diag_embed(mu * pinv * pinv) + torch.diag_embed(1.0 - a)
            rhs = torch.stack([gb, a], dim=-1)
            sol = _spd_solve(hb + 1e-14 * eye, rhs)  # positive definite by construction
            xg, xa = sol[..., 0], sol[..., 1]
            nu = -(a * xg).sum(-1, keepdim=True) / (a * xa).sum(-1, keepdim=True).clamp_min(1e-300)
            step = -(xg + nu * xa) * a
            decrement = -(gb * step).sum(-1)
            worst = float(decrement.max())
            # quadratic convergence ends at the rounding floor of the decrement
            if worst <= 1e-15 or (worst <= 1e-12 and worst >= 0.1 * previous):
                break
            previous = worst
            neg = step < 0
            safe = torch.where(neg, step, -torch.ones_like(step))
            ratio = torch.where(neg, -p / safe, torch.full_like(p, 2.0))
            t = (0.99 * ratio.amin(-1, keepdim=True)).clamp(max=1.0)
            f0 = _objective(omega, p, s, active, mu)
            for _ in range(60):
                cand = p + t * step
                f1 = _objective(omega, cand, s, active, mu)
                ok = (f1 <= f0 - 0.25 * t.squeeze(-1) * decrement) | (decrement <= 1e-15)
                if bool(ok.all()):
                    break
                t = torch.where(ok.unsqueeze(-1), t, 0.5 * t)
            p = torch.where(active, (p + t * step).clamp_min(1e-300), torch.zeros_like(p))
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    # KKT residual at the final point
    _, g, _ = _grad_hess(omega, p)
    c = torch.where(active, g - s, torch.full_like(g, float("inf")))
    cmin = c.amin(-1, keepdim=True)
    gap = torch.where(active, p * (c - cmin), torch.zeros_like(p))
    residual = float(gap.amax()) if gap.numel() else 0.0
    weights = torch.where(n_active > 0, p, torch.zeros_like(p))
    converged = residual <= tol and iterations < max_iter
    if not converged:
        warnings.warn(
            f"solve_regularized did not converge: KKT residual {residual:.3g} > tol={tol:g} "
            f"after {iterations} Newton steps (mu = {mu:g})",
            RuntimeWarning,
            stacklevel=2,
        )
    return RegularizedSolution(
        weights=weights.movedim(-1, dim).to(scores.dtype),
        iterations=iterations,
        converged=converged,
        kkt_residual=residual,
        barrier=mu,
    )
