r"""Batched damped-Newton core of the MEM / Fenchel-dual solver (internal).

Everything here works on *canonical* tensors: templates ``T (K, n, d)``, evidence
``z (K, Q, d)`` and log-preference ``logu (K, Q or 1, n)``. ``K`` enumerates the distinct
template sets and ``Q`` the problems sharing each set (e.g. all queries of a head), so the
Gram matrix ``G = T Tᵀ`` and every product with ``T`` is formed once per template set and
never copied per query.

Dual (fenchel-dual-attention eq. 7), with ``b = μ + z`` and ``p(λ) = softmax(log u + Tλ)``:

.. math:: f(λ) = \langle λ, b\rangle - \|λ\|^2/(2α) - \log \textstyle\sum_i u_i e^{\langle t_i, λ\rangle},
          \quad ∇f = b - λ/α - T^\top p, \quad -∇^2 f = A = I/α + T^\top W T,

``W = diag(p) − ppᵀ``. Two linear algebra paths:

* ``lowrank`` (used when ``n < d``): the optimum satisfies ``λ* = α(b − Tᵀp*)``, so the
  iterates are kept in the affine set ``λ = αb + Tᵀβ`` (``β ∈ R^n``). The Newton step is
  then ``δβ = −(I/α + W G)^{-1} r`` with ``r = β/α + p`` (this is the Woodbury form of
  ``A^{-1}``) — an ``n × n`` solve and only ``O(n²)`` work per problem and iteration.
* ``dense`` (``n ≥ d``): ``δλ = A^{-1} ∇f`` by a ``d × d`` Cholesky solve.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["newton_mem", "apply_inverse_hessian", "gram", "tol_floor"]

_ARMIJO = 1e-4
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_MAX_BACKTRACK = 40


def gram(T: Tensor) -> Tensor:
    """``G = T Tᵀ`` of ``T (K, n, d)``, shape ``(K, n, n)``."""
    return T @ T.transpose(-1, -2)


def tol_floor(T: Tensor, b: Tensor) -> Tensor:
    """Smallest gradient norm resolvable in ``T.dtype``: ``64 eps (1 + ‖b‖ + max_i ‖t_i‖)``.

    Shape ``(K, Q)``.
    """
    eps = torch.finfo(T.dtype).eps
    tmax = T.norm(dim=-1).amax(dim=-1)  # (K,)
    return 64.0 * eps * (1.0 + b.norm(dim=-1) + tmax[:, None])


def _lowrank_matrix(G: Tensor, p: Tensor, alpha: float) -> Tensor:
    """``I/α + W G`` for ``W = diag(p) − ppᵀ``; ``G (K,n,n)``, ``p (K,Q,n)`` -> ``(K,Q,n,n)``."""
    pG = p @ G  # (K, Q, n)
    M = p.unsqueeze(-1) * (G.unsqueeze(1) - pG.unsqueeze(-2))
    M.diagonal(dim1=-2, dim2=-1).add_(1.0 / alpha)
    return M


def _dense_matrix(T: Tensor, p: Tensor, alpha: float) -> Tensor:
    """``A = I/α + Tᵀ diag(p) T − hhᵀ`` (``h = Tᵀp``); ``T (K,n,d)``, ``p (K,Q,n)`` -> ``(K,Q,d,d)``.

    The second moment ``Σᵢ pᵢ tᵢtᵢᵀ`` is one GEMM against the outer products ``tᵢtᵢᵀ``
    (``K·n·d²`` memory) when ``d < Q``, else formed from ``p ⊙ T`` (``K·Q·n·d``).
    """
    K, Q, n = p.shape
    d = T.shape[-1]
    h = p @ T  # (K, Q, d)
    if d < Q:
        outer = (T.unsqueeze(-1) * T.unsqueeze(-2)).reshape(K, n, d * d)
        second = (p @ outer).reshape(K, Q, d, d)
    else:
        second = (T.unsqueeze(1) * p.unsqueeze(-1)).transpose(-1, -2) @ T.unsqueeze(1)
    A = second - h.unsqueeze(-1) * h.unsqueeze(-2)
    A.diagonal(dim1=-2, dim2=-1).add_(1.0 / alpha)
    return A


def _w_apply(p: Tensor, v: Tensor) -> Tensor:
    """``W v = p ⊙ (v − <p, v>)`` for ``W = diag(p) − ppᵀ``."""
    return p * (v - (p * v).sum(-1, keepdim=True))


def _cg_lowrank(G: Tensor, p: Tensor, alpha: float, y: Tensor, rtol: Tensor, max_cg: int) -> Tensor:
    """Solve ``(I/α + W G) x = y`` by conjugate gradients in the ``G`` inner product.

    ``I/α + WG`` is self-adjoint and positive definite for ``<x, y>_G = xᵀGy`` (it is the
    Hessian ``A = I/α + TᵀWT`` written in the coordinates ``λ = Tᵀx``), so CG applies; each
    iteration costs one batched ``(K,Q,n) @ (K,n,n)`` product. Stops per problem when
    ``‖Tᵀ(y − Mx)‖ ≤ rtol ‖Tᵀy‖``.
    """
    x = torch.zeros_like(y, memory_format=torch.contiguous_format)
    rho = y.contiguous().clone()
    Grho = rho @ G
    d, Gd = rho.clone(), Grho.clone()
    gamma = torch.linalg.vecdot(rho, Grho)
    stop = gamma.clamp(min=0) * rtol.square()
    tiny = torch.finfo(y.dtype).tiny
    inv_alpha = 1.0 / alpha
    early_exit = not _is_wrapped(gamma)  # no bool() on a vmapped tensor: every iteration, masked
    for _ in range(max_cg):
        active = gamma > stop
        if early_exit and not bool(active.any()):
            break
        # W (G d) = p ⊙ (Gd − <p, Gd>)
        WGd = torch.sub(Gd, torch.linalg.vecdot(p, Gd).unsqueeze(-1)).mul_(p)
        GMd = torch.baddbmm(Gd, WGd, G, beta=inv_alpha)  # G M d = Gd/α + G W G d
        Md = WGd.add_(d, alpha=inv_alpha)  # M d = d/α + W G d (reuses WGd's storage)
        curv = torch.linalg.vecdot(d, GMd)
        a = torch.where(active, gamma / curv.clamp(min=tiny), torch.zeros_like(gamma)).unsqueeze(-1)
        if early_exit:
            x.addcmul_(a, d)
            rho.addcmul_(a, Md, value=-1.0)
            Grho.addcmul_(a, GMd, value=-1.0)
        else:  # (vmap has no batching rule for addcmul_)
            x.add_(a * d)
            rho.sub_(a * Md)
            Grho.sub_(a * GMd)
        gamma_new = torch.linalg.vecdot(rho, Grho)
        beta = torch.where(active, gamma_new / gamma.clamp(min=tiny), torch.zeros_like(gamma)).unsqueeze(-1)
        d.mul_(beta).add_(rho)
        Gd.mul_(beta).add_(Grho)
        gamma = torch.where(active, gamma_new, gamma)
    return x


def lowrank_solve(G: Tensor, p: Tensor, alpha: float, y: Tensor, rtol: Tensor | float) -> Tensor:
    """``(I/α + W G)^{-1} y`` for ``y (K,Q,n)``: direct LU when small, else CG to ``rtol``."""
    K, Q, n = y.shape[0], max(y.shape[1], p.shape[1]), y.shape[-1]
    if K * Q * n * n <= THRESHOLDS.mem_direct_max_entries:
        return torch.linalg.solve(_lowrank_matrix(G, p, alpha), y.expand(K, Q, n).unsqueeze(-1)).squeeze(-1)
    rt = torch.as_tensor(rtol, dtype=y.dtype, device=y.device).expand(K, Q)
    return _cg_lowrank(G, p.expand(K, Q, n), alpha, y.expand(K, Q, n), rt, max_cg=max(4 * n, 50))


def apply_inverse_hessian(
    T: Tensor, G: Tensor | None, p: Tensor, alpha: float, rhs: Tensor, lowrank: bool
) -> Tensor:
    """Solve ``(I/α + Cov_p[t]) y = rhs`` for ``rhs (K, Q, d)`` (to working precision).

    ``p`` is ``(K, Q or 1, n)``. The low-rank path uses Woodbury:
    ``y = α (rhs − Tᵀ (I/α + W G)^{-1} W T rhs)``.
    """
    if lowrank:
        assert G is not None
        WTrhs = _w_apply(p, rhs @ T.transpose(-1, -2))
        x = lowrank_solve(G, p, alpha, WTrhs, 16 * torch.finfo(rhs.dtype).eps)
        return alpha * (rhs - x @ T)
    A = _dense_matrix(T, p, alpha)
    L = torch.linalg.cholesky(A)
    return torch.cholesky_solve(rhs.unsqueeze(-1), L).squeeze(-1)


def _backtrack(
    phi0: Tensor, slope: Tensor, phi_at: object, active: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Backtracking (Armijo) line search, vectorized over problems.

    Returns ``(t, ok)``: the accepted step sizes (0 where none was accepted) and a mask of
    problems whose search succeeded. ``phi_at(t)`` evaluates the dual objective along the step.
    """
    assert callable(phi_at)
    t = torch.ones_like(phi0)
    ok = ~active
    slack = 8.0 * eps * (1.0 + phi0.abs())
    for _ in range(_MAX_BACKTRACK):
        phi = phi_at(t)
        accept = (phi >= phi0 + _ARMIJO * t * slope - slack) & ~ok
        ok = ok | accept
        if bool(ok.all()):
            break
        t = torch.where(ok, t, 0.5 * t)
    return torch.where(ok & active, t, torch.zeros_like(t)), ok


def newton_mem(
    T: Tensor, z: Tensor, logu: Tensor, alpha: float, tol: float, max_iter: int, lowrank: bool
) -> tuple[Tensor, Tensor, int, Tensor, Tensor]:
    """Damped Newton on the dual (7) for canonical inputs.

    Args:
        T: (K, n, d) templates. z: (K, Q, d) evidence. logu: (K, Q or 1, n) log preference
            (``-inf`` = excluded template; at least one finite entry per row).
    Returns:
        ``(lam (K,Q,d), weights (K,Q,n), iterations, grad_norm (K,Q), tol_eff (K,Q))``.
    """
    eps = torch.finfo(T.dtype).eps
    u_bar = torch.softmax(logu, dim=-1)  # normalized preference
    b = u_bar @ T + z  # μ + z, (K, Q, d)
    G = gram(T) if lowrank else None
    floor = tol_floor(T, b)
    tol_eff = torch.clamp(floor, min=tol)  # what `converged` is judged against (at the end)
    # Iterate to a bit below the floor (the in-loop gradient and the one re-measured from λ*
    # differ by rounding), but stop a problem whose gradient no longer decreases near the floor.
    target = torch.clamp(0.5 * floor, min=tol)
    stalled = torch.zeros(b.shape[:-1], dtype=torch.bool, device=b.device)
    prev = torch.full(b.shape[:-1], float("inf"), dtype=b.dtype, device=b.device)
    iterations = 0
    # Both paths start from the second-order approximation (13): λ0 = (I/α + Σ_u)^{-1} z.
    if lowrank:
        assert G is not None
        c = alpha * (b @ T.transpose(-1, -2)) + logu  # log u + α T b, (K, Q, n)
        # λ0 = αb + Tᵀβ0  <=>  β0 = −α (ū + M_u^{-1} W_u T z)  (Woodbury form of λ0; a rough
        # solve is enough for a starting point).
        WTz = _w_apply(u_bar, z @ T.transpose(-1, -2))
        beta = -alpha * (u_bar + lowrank_solve(G, u_bar, alpha, WTz, 1e-3))
        beta = beta.expand(b.shape[:-1] + (T.shape[-2],)).contiguous()
        for it in range(max_iter + 1):
            bG = beta @ G
            s = c + bG
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - lse)
            r = beta / alpha + p
            # ‖∇f‖ = ‖Tᵀr‖ = sqrt(rᵀGr): an n×n product instead of n×d (the returned
            # grad_norm is re-measured from λ* at the end)
            gnorm = torch.linalg.vecdot(r, r @ G).clamp(min=0).sqrt()
            stalled = stalled | ((gnorm >= 0.9 * prev) & (gnorm <= 8 * floor))
            prev = gnorm
            active = (gnorm > target) & ~stalled
            iterations = it
            if it == max_iter or not bool(active.any()):
                break
            # inexact Newton: relative accuracy min(0.1, ‖g‖) keeps quadratic convergence
            delta = -lowrank_solve(G, p, alpha, r, torch.clamp(gnorm, max=0.1))
            delta = torch.where(active.unsqueeze(-1), delta, torch.zeros_like(delta))
            Gd = delta @ G
            bGb, dGb, dGd = (beta * bG).sum(-1), (delta * bG).sum(-1), (delta * Gd).sum(-1)
            phi0 = -bGb / (2 * alpha) - lse.squeeze(-1)
            slope = -(Gd * r).sum(-1)

            def phi_lr(
                t: Tensor, s: Tensor = s, Gd: Tensor = Gd, bGb: Tensor = bGb, dGb: Tensor = dGb,
                dGd: Tensor = dGd,
            ) -> Tensor:
                quad = bGb + 2 * t * dGb + t * t * dGd
                return -quad / (2 * alpha) - torch.logsumexp(s + t.unsqueeze(-1) * Gd, dim=-1)

            step, ok = _backtrack(phi0, slope, phi_lr, active, eps)
            stalled = stalled | (active & ~ok)
            beta = beta + step.unsqueeze(-1) * delta
        lam = alpha * b + beta @ T
    else:
        lam = apply_inverse_hessian(T, G, u_bar, alpha, z, lowrank).expand(b.shape).contiguous()
        Tt = T.transpose(-1, -2)
        for it in range(max_iter + 1):
            s = logu + lam @ Tt
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - lse)
            g = b - lam / alpha - p @ T
            gnorm = g.norm(dim=-1)
            stalled = stalled | ((gnorm >= 0.9 * prev) & (gnorm <= 8 * floor))
            prev = gnorm
            active = (gnorm > target) & ~stalled
            iterations = it
            if it == max_iter or not bool(active.any()):
                break
            L, info = torch.linalg.cholesky_ex(_dense_matrix(T, p, alpha))
            delta = torch.cholesky_solve(g.unsqueeze(-1), L).squeeze(-1)
            delta = torch.where(active.unsqueeze(-1) & (info == 0).unsqueeze(-1), delta, g * alpha)
            delta = torch.where(active.unsqueeze(-1), delta, torch.zeros_like(delta))
            Td = delta @ Tt
            lb, db = (lam * b).sum(-1), (delta * b).sum(-1)
            ll, dl, dd = (lam * lam).sum(-1), (delta * lam).sum(-1), (delta * delta).sum(-1)
            phi0 = lb - ll / (2 * alpha) - lse.squeeze(-1)
            slope = (g * delta).sum(-1)

            def phi_dense(
                t: Tensor, s: Tensor = s, Td: Tensor = Td, lb: Tensor = lb, db: Tensor = db, ll: Tensor = ll,
                dl: Tensor = dl, dd: Tensor = dd,
            ) -> Tensor:
                quad = ll + 2 * t * dl + t * t * dd
                lin = lb + t * db
                return lin - quad / (2 * alpha) - torch.logsumexp(s + t.unsqueeze(-1) * Td, dim=-1)

            step, ok = _backtrack(phi0, slope, phi_dense, active, eps)
            stalled = stalled | (active & ~ok)
            lam = lam + step.unsqueeze(-1) * delta
    # Recover p̃ from λ* (eq. 9) and report the gradient measured at λ* itself.
    weights = torch.softmax(logu + lam @ T.transpose(-1, -2), dim=-1)
    grad = b - lam / alpha - weights @ T
    if not bool(torch.isfinite(lam).all()):
        raise FloatingPointError("MEM dual solve produced non-finite values (inputs too large?)")
    return lam, weights, iterations, grad.norm(dim=-1), tol_eff
