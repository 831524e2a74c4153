r"""Exact MEM attention, differentiable by implicit differentiation (fenchel-dual-attention eq. 7, 9–10).

The forward pass solves the dual (7) with the batched Newton solver; the backward pass
differentiates through the optimality condition ``g(λ*) = μ + z − λ*/α − Tᵀp(λ*) = 0``
(implicit function theorem, no unrolling). With ``A = I/α + Cov_p[t]``, ``W = diag p − ppᵀ``
and upstream ``ω = ∂L/∂p̃``:

.. math:: y = A^{-1} T^\top W ω,\quad q = W(ω - T y),\quad
          ∂L/∂t_i = q_i λ^* + (ū_i - p̃_i)\, y,\quad ∂L/∂z = y,\quad
          ∂L/∂\log u_i = q_i + ū_i(\langle t_i, y\rangle - \textstyle\sum_j ū_j \langle t_j, y\rangle)

one extra Hessian solve per backward (Woodbury/CG when n < d, Cholesky otherwise).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from attnopt._func import under_transform
from attnopt._validation import (
    empty_attention,
    empty_weights,
    resolve_scale,
    validate_attention,
)
from attnopt.dual._mem_batch import canonicalize, check_alpha, check_solver_knobs, safe_log, validate
from attnopt.dual._mem_core import _w_apply, apply_inverse_hessian, gram, newton_mem
from attnopt.functional._autograd import first_order_only, refuse_double_backward
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional.generalized import score_bias

__all__ = ["mem_estimate", "mem_weights", "mem_attention"]


class _MEMWeights(torch.autograd.Function):
    """Canonical ``T (K,n,d), z (K,Q,d), logu (K,Q|1,n)`` -> exact weights ``p̃ (K,Q,n)``."""

    @staticmethod
    def forward(
        T: Tensor, z: Tensor, logu: Tensor, alpha: float, tol: float, max_iter: int, lowrank: bool
    ) -> tuple[Tensor, Tensor]:
        lam, w, _, gnorm, tol_eff = newton_mem(T, z, logu, alpha, tol, max_iter, lowrank)
        if not bool((gnorm <= tol_eff).all()):
            warnings.warn(
                f"MEM attention: dual solve did not converge in {max_iter} Newton iterations "
                f"(max grad norm {float(gnorm.max()):.3e} > tol {tol:.1e})",
                RuntimeWarning,
                stacklevel=4,
            )
        return w, lam

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        T, _, logu, alpha, _, _, lowrank = inputs
        w, lam = output
        ctx.alpha, ctx.lowrank = alpha, lowrank
        ctx.logu_shape = logu.shape
        ctx.save_for_backward(T, logu, w, lam)
        ctx.mark_non_differentiable(lam)
        if under_transform():  # forward mode happens there only (torch.func, forward_ad dual levels)
            ctx.save_for_forward(T, logu, w, lam)

    @staticmethod
    def jvp(
        ctx: Any, T_t: Tensor | None, z_t: Tensor | None, logu_t: Tensor | None, *_: Any
    ) -> tuple[Tensor, None]:
        r"""Forward mode by the same implicit function theorem: with ``s = log u + Tλ``,
        ``ū = softmax(log u)`` and the optimality condition ``Tᵀū + z − λ/α − Tᵀp = 0``,

        .. math:: A\,dλ = dz + dTᵀ(ū - p) + Tᵀ W_ū\, d\log u - Tᵀ W_p (d\log u + dT\,λ),\qquad
                  dp = W_p (d\log u + dT\,λ + T\,dλ)

        (``A = I/α + Cov_p[t]``, one Hessian solve, as the backward)."""
        T, logu, p, lam = ctx.saved_for_forward
        u_bar = torch.softmax(logu, dim=-1).expand_as(p)
        rhs = torch.zeros_like(lam)
        ds = torch.zeros_like(p)
        if z_t is not None:
            rhs = rhs + z_t
        if T_t is not None:
            rhs = rhs + (u_bar - p) @ T_t
            ds = ds + lam @ T_t.transpose(-1, -2)
        if logu_t is not None:
            lt = logu_t.expand_as(p)
            rhs = rhs + _w_apply(u_bar, lt) @ T
            ds = ds + lt
        rhs = rhs - _w_apply(p, ds) @ T
        dlam = apply_inverse_hessian(T, gram(T) if ctx.lowrank else None, p, ctx.alpha, rhs, ctx.lowrank)
        return _w_apply(p, ds + dlam @ T.transpose(-1, -2)), None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], T: Tensor, z: Tensor, logu: Tensor, alpha: float,
        tol: float, max_iter: int, lowrank: bool,
    ) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        """``torch.func.vmap``: the vmapped dimension joins the problem batch ``K`` (an input
        without it is expanded), one solve for the whole batch; the outputs get it back in front."""
        size = info.batch_size

        def fold(x: Tensor, dim: int | None) -> Tensor:
            x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
            return x.reshape(size * x.shape[1], *x.shape[2:])

        w, lam = _MEMWeights.apply(fold(T, in_dims[0]), fold(z, in_dims[1]), fold(logu, in_dims[2]),
                                   alpha, tol, max_iter, lowrank)
        return (w.view(size, -1, *w.shape[1:]), lam.view(size, -1, *lam.shape[1:])), (0, 0)

    @staticmethod
    def backward(ctx: Any, grad_w: Tensor, _grad_lam: Tensor | None) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "mem_attention / mem_weights", "no plain path (implicit differentiation)")
        T, logu, p, lam = ctx.saved_tensors
        alpha, lowrank = ctx.alpha, ctx.lowrank
        u_bar = torch.softmax(logu, dim=-1).expand_as(p)
        v = _w_apply(p, grad_w) @ T  # Tᵀ W ω, (K, Q, d)
        y = apply_inverse_hessian(T, gram(T) if lowrank else None, p, alpha, v, lowrank)
        Ty = y @ T.transpose(-1, -2)  # (K, Q, n)
        q = _w_apply(p, grad_w - Ty)
        grad_T = q.transpose(-1, -2) @ lam + (u_bar - p).transpose(-1, -2) @ y
        grad_logu = q + u_bar * (Ty - (u_bar * Ty).sum(-1, keepdim=True))
        if ctx.logu_shape[1] == 1 and grad_logu.shape[1] != 1:
            grad_logu = grad_logu.sum(1, keepdim=True)
        grads = (grad_T, y, grad_logu, None, None, None, None)
        return first_order_only(ctx, grads, "mem_attention / mem_weights")


def _solve_weights(
    templates: Tensor, z: Tensor, logu: Tensor | None, batch: tuple[int, ...], alpha: float,
    tol: float, max_iter: int,
) -> Tensor:
    """Differentiable exact weights, shape ``(*batch, n)``; computes half precision in float32."""
    dtype = templates.dtype
    cdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    n, d = templates.shape[-2:]
    cb = canonicalize(templates.to(cdt), z.to(cdt), None if logu is None else logu.to(cdt), batch)
    w, _ = _MEMWeights.apply(cb.T, cb.z, cb.logu, alpha, float(tol), max_iter, n < d)
    return cb.restore(w).to(dtype)


def mem_estimate(
    templates: Tensor,
    z: Tensor,
    *,
    preference: Tensor | None = None,
    alpha: float = 1.0,
    tol: float = 1e-8,
    max_iter: int = 50,
) -> Tensor:
    r"""The exact MEM estimate ĥ, differentiable w.r.t. templates, z and preference (eq. 9–10).

    .. math:: \hat h = \sum_i \tilde p_i t_i,\qquad \tilde p_i ∝ ū_i e^{\langle t_i, λ^*\rangle}

    Same inputs and batching convention as :func:`attnopt.dual.solve_mem`; gradients by
    implicit differentiation of the dual optimality condition (module docstring).

    Returns:
        (*S, d) ĥ in the input dtype.
    Raises:
        ValueError, TypeError: as :func:`attnopt.dual.solve_mem`.
    Warns:
        RuntimeWarning: the dual solve did not converge.
    """
    alpha = check_alpha(alpha)
    check_solver_knobs(tol, max_iter)
    batch = validate(templates, z, preference)
    logu = None if preference is None else safe_log(preference)
    w = _solve_weights(templates, z, logu, batch, alpha, tol, max_iter)
    return (w.unsqueeze(-2) @ templates).squeeze(-2)


def mem_weights(
    q: Tensor,
    k: Tensor,
    *,
    preference: Tensor | None = None,
    log_preference: Tensor | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    tol: float = 1e-8,
    max_iter: int = 50,
) -> Tensor:
    r"""Exact MEM attention weights: templates = keys, evidence = queries, α = ``scale``.

    For each query ``i``: :math:`π_{i·} = \tilde p` of the MEM problem with templates
    ``k_j``, evidence ``z = q_i``, preference ``u_ij · exp(m_ij)`` (``m`` = mask) and
    ``α = scale``. To first order in α this is :func:`attnopt.generalized_weights` (eq. 16).

    Args: as :func:`attnopt.generalized_weights`, plus the solver knobs ``tol``, ``max_iter``.
    Returns:
        (B, H, Nq, Nk) row-stochastic weights; rows with no admissible key are zeros.
    Raises:
        ValueError, TypeError: as :func:`attnopt.generalized_weights`, and bad ``tol``/``max_iter``.
    Warns:
        RuntimeWarning: the dual solve did not converge.
    """
    nq, nk, d = validate_attention(q, k, None, attn_mask)
    alpha = resolve_scale(scale, d)
    check_solver_knobs(tol, max_iter)
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    bias = score_bias(q, k, preference, log_preference, attn_mask, is_causal, cdt)
    empty = empty_weights(q, k, preference, log_preference)
    if empty is not None:
        return empty
    full = (*batch, nq)
    if bias is None:
        return _solve_weights(k.unsqueeze(-3), q, None, full, alpha, tol, max_iter)
    bias = bias.to(cdt)
    valid = torch.isfinite(bias).any(-1, keepdim=True)  # rows with an admissible key
    logu = torch.where(valid, bias, torch.zeros_like(bias))
    w = _solve_weights(k.unsqueeze(-3), q, logu, full, alpha, tol, max_iter)
    return w * valid.to(w.dtype)


def mem_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    preference: Tensor | None = None,
    log_preference: Tensor | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    tol: float = 1e-8,
    max_iter: int = 50,
    dropout_p: float = 0.0,
) -> Tensor:
    r"""Exact MEM / Fenchel-dual attention (fenchel-dual-attention eq. 7, 9–10).

    .. math:: \mathrm{out}_i = \sum_j \tilde p_{ij} v_j,\qquad
              \tilde p_{ij} ∝ u_{ij} e^{m_{ij}} \exp\langle k_j, λ^*_i\rangle

    where ``λ*_i`` maximizes the dual (7) for templates ``k``, evidence ``q_i`` and
    ``α = scale``. :func:`attnopt.generalized_attention` is its first-order approximation
    (``λ ≈ α q_i``, eq. 14–16). With ``v = k`` the output is the exact ĥ. Differentiable
    w.r.t. ``q``, ``k``, ``v`` and ``preference`` by implicit differentiation (no unrolling).
    Costs a batched Newton solve per call: an analysis / small-model tool, not a fast kernel.

    Args:
        q: (B, H, Nq, d) queries = evidence ``z``. k: (B, H, Nk, d) keys = templates.
        v: (B, H, Nk, dv) values.
        preference, log_preference, attn_mask, scale, is_causal: as
            :func:`attnopt.generalized_attention` (``scale`` = α, default ``1/sqrt(d)``).
        tol, max_iter: Newton solver knobs (see :func:`attnopt.dual.solve_mem`).
        dropout_p: dropout probability on the weights ``p̃`` before the sum over values (as in
            SDPA: applied whenever > 0).
    Returns:
        (B, H, Nq, dv); rows with no admissible key are zeros.
    Raises:
        ValueError, TypeError: as :func:`attnopt.generalized_attention`; bad ``tol``/``max_iter``.
    Warns:
        RuntimeWarning: the dual solve did not converge.
    """
    validate_attention(q, k, v, attn_mask)
    dropout_p = check_dropout_p(dropout_p)
    empty = empty_attention(q, k, v, preference, log_preference)
    if empty is not None:
        mem_weights(q, k, preference=preference, log_preference=log_preference, attn_mask=attn_mask,
                    scale=scale, is_causal=is_causal, tol=tol, max_iter=max_iter)  # the same checks
        return empty
    w = mem_weights(
        q, k, preference=preference, log_preference=log_preference, attn_mask=attn_mask,
        scale=scale, is_causal=is_causal, tol=tol, max_iter=max_iter,
    )
    if dropout_p > 0.0:
        return dropout_attention(w, v, dropout_p, w.dtype)
    return w @ v
