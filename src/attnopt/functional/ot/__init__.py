r"""Optimal-transport-based attention (fenchel-dual-attention Sec. 9, eq. 22, App. D).

Replacing ``KL(p‖u)`` of the MEM problem by the entropic OT distance ``W_γ(p, u; M)`` (eq. 20)
lets templates of a bank ``A`` that are *similar* to the input templates (small cost ``M``)
receive attention mass. For small ``α`` and ``α/γ`` the minimizer is (eq. 22)

.. math:: p^*(a) = \sum_{i=1}^n u_i\,
          \frac{\exp\big((\alpha a^\top z - M(a, t_i))/\gamma\big)}{Z_i},\qquad
          Z_i = \sum_{a' \in A} \exp\big((\alpha a'^\top z - M(a', t_i))/\gamma\big),

and the attention output is ``ĥ = Σ_a p*(a) v_a`` (``v_a = a`` in the paper).

One implementation, plain PyTorch on any device (:mod:`.reference`): there is nothing for a
router to choose (``last_dispatch["ot"]`` says ``"reference"`` under that backend); the cost
specification and the kernel ``K`` are in :mod:`.cost`. With the kernel
``K_{a,i} = exp(−M(a,t_i)/γ)`` and ``E_{k,a} = exp(α z_kᵀa/γ)`` this is ``Z = E·K`` and
``p*_k = E_k ⊙ (K·(u/Z_k))``: two matrix products per head, evaluated here as stabilized
log-domain matrix products (:func:`log_matmul_exp`), so memory is ``O((Nq + n)·m)`` — never an
``Nq × n × m`` tensor. The exact solution of the dual (36) is :func:`attnopt.dual.solve_ot_mem`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import check_broadcastable, check_finite, check_tensor, zero_anchor
from attnopt.functional import dispatch
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional.ot.cost import (
    CostSpec,
    check_ot_inputs,
    check_positive,
    log_kernel,
    normalized_preference,
)
from attnopt.functional.ot.reference import log_matmul_exp, ot_log_weights

__all__ = ["ot_attention", "ot_weights", "log_matmul_exp"]


def _empty(
    z: Tensor, templates: Tensor, bank: Tensor | None, bank_values: Tensor | None, weights: bool
) -> Tensor | None:
    """Entry checks shared with every op (finiteness; empty sizes -> empty / zeros), or ``None``.

    ``Nq = 0`` or an empty batch gives an empty result; no template (``n = 0``) or no bank
    member (``m = 0``) gives zeros, as an all-zero preference does.
    """
    bank_t, batch = check_ot_inputs(z, templates, bank, allow_empty=True)
    check_finite(z=z, templates=templates, bank=bank, bank_values=bank_values)
    dispatch.use_reference("ot", z)  # one implementation, plain PyTorch: it is the reference
    nq, n, m = z.shape[-2], templates.shape[-2], bank_t.shape[-2]
    if nq and n and m and 0 not in batch:
        return None
    width = m if weights else (z.shape[-1] if bank_values is None else bank_values.shape[-1])
    anchor = zero_anchor(*(x for x in (z, templates, bank, bank_values) if x is not None))
    return z.new_zeros((*batch, nq, width)) + anchor.to(z.dtype)


def _prepare(
    z: Tensor,
    templates: Tensor,
    bank: Tensor | None,
    preference: Tensor | None,
    cost: CostSpec,
    alpha: float,
    gamma: float,
    bank_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, float, float, tuple[int, ...]]:
    bank_t, batch = check_ot_inputs(z, templates, bank)
    alpha = check_positive("alpha", alpha)
    gamma = check_positive("gamma", gamma)
    compute = torch.float32 if z.dtype in (torch.float16, torch.bfloat16) else z.dtype
    m, n = bank_t.shape[-2], templates.shape[-2]
    u = normalized_preference(preference, batch, n, compute, z.device)
    log_k = log_kernel(cost, bank_t, templates, gamma, square=bank is None, dtype=compute, batch=batch)
    if bank_mask is not None:
        check_tensor("bank_mask", bank_mask, min_dim=1, floating=False)
        if bank_mask.dtype != torch.bool:
            raise TypeError(f"bank_mask must be boolean (True = may receive mass), got {bank_mask.dtype}")
        check_broadcastable("bank_mask", bank_mask, (*batch, m))
    return z.to(compute), bank_t.to(compute), u, log_k, bank_mask, alpha, gamma, batch


@dispatch.profiled
def ot_weights(
    z: Tensor,
    templates: Tensor,
    *,
    bank: Tensor | None = None,
    preference: Tensor | None = None,
    cost: CostSpec = "neg_dot",
    alpha: float = 1.0,
    gamma: float = 1.0,
    bank_mask: Tensor | None = None,
) -> Tensor:
    r"""The OT-attention weights ``p*`` over the bank, fenchel-dual-attention eq. (22).

    .. math:: p^*_k(a) = \sum_i u_i \frac{\exp((\alpha a^\top z_k - M(a,t_i))/\gamma)}
              {\sum_{a'} \exp((\alpha a'^\top z_k - M(a',t_i))/\gamma)}

    Shapes: B batch, H heads, Nq queries, n templates, m bank members, d features.

    Args:
        z: (B, H, Nq, d) evidence, one per query.
        templates: (B, H, n, d) the input templates ``t_i`` (those holding preference).
        bank: (B, H, m, d) the set ``A`` that may receive mass (default: ``templates``).
        preference: ``u >= 0`` broadcastable to (B, H, n); default uniform. It is normalized
            to sum 1; zero entries drop a template; an all-zero row gives all-zero weights.
        cost: ``"neg_dot"`` (``M(a,b) = −aᵀb + C``, the paper's experiment; ``C`` cancels),
            ``"sqeuclidean"`` (``‖a−b‖²``), a callable ``cost(bank, templates) -> (..., m, n)``
            or an explicit (..., m, n) tensor ``M[a, i] = M(a, t_i)``. Callables and tensors must
            be non-negative (``+inf`` allowed: kernel 0), NaN-free, give every template a finite
            cost to some bank member, and — when ``bank`` is ``None`` (square ``M`` over ``A×A``)
            — be symmetric. With an explicit ``bank`` only the ``A×T`` block is seen, so symmetry
            cannot be checked.
        alpha: reliability ``α > 0`` of the evidence.
        gamma: entropic strength ``γ > 0``.
        bank_mask: optional boolean, broadcastable to (B, H, m); ``False`` = this bank member
            may receive no mass (padding). A template whose every finite-cost bank member is
            masked drops out (its mass is lost).

    Returns:
        (B, H, Nq, m) non-negative weights, each row summing to 1 (0 for an all-zero
        preference, and for no template, ``n = 0``; ``Nq = 0`` or ``m = 0`` gives an empty
        result). Half precision is computed in float32 and returned in the input dtype.

    Raises:
        TypeError: non-tensor / non-floating inputs, mixed dtypes, non-number ``alpha``/``gamma``,
            a cost of an unsupported type, a non-boolean ``bank_mask``.
        ValueError: NaN or ±inf in ``z``, ``templates``, ``bank`` (or ``bank_values``);
            mismatched shapes, ``alpha``/``gamma`` not finite and > 0, a negative,
            NaN or infinite preference, a cost that fails its checks, an unknown cost name.
    """
    check_positive("alpha", alpha), check_positive("gamma", gamma)
    empty = _empty(z, templates, bank, None, weights=True)
    if empty is not None:
        return empty
    zc, bank_c, u, log_k, mask, alpha, gamma, _ = _prepare(
        z, templates, bank, preference, cost, alpha, gamma, bank_mask
    )
    return torch.exp(ot_log_weights(zc, bank_c, u, log_k, alpha, gamma, mask)).to(z.dtype)


@dispatch.profiled
def ot_attention(
    z: Tensor,
    templates: Tensor,
    *,
    bank: Tensor | None = None,
    bank_values: Tensor | None = None,
    preference: Tensor | None = None,
    cost: CostSpec = "neg_dot",
    alpha: float = 1.0,
    gamma: float = 1.0,
    bank_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    r"""OT-based attention ``ĥ = Σ_{a∈A} p*(a) v_a``, fenchel-dual-attention eq. (22) into (4).

    .. math:: \hat h_k = \sum_{a \in A} p^*_k(a)\, v_a, \qquad
              p^*_k = E_k \odot \big(K\,(u / Z_k)\big),\ Z = E K

    For ``cost="neg_dot"`` this equals ``Σ_i u_i · softmax-attention(query=(αz + t_i)/γ,
    keys=A, values=V)``. Computed with two stabilized log-domain matmuls per head:
    time ``O(Nq·n·m + (Nq + n)·m·d)``, memory ``O((Nq + n)·m)``.

    Args:
        z, templates, bank, preference, cost, alpha, gamma, bank_mask: as :func:`ot_weights`.
        bank_values: (B, H, m, dv) the values ``v_a`` (default: the bank itself, so
            ``ĥ = Σ p*(a) a`` as in the paper).
        dropout_p: dropout probability on the weights ``p*`` before the sum over values (as
            in SDPA: applied whenever > 0).

    Returns:
        (B, H, Nq, dv) in the dtype of ``z`` (zeros for an all-zero preference row).

    Raises:
        TypeError, ValueError: as :func:`ot_weights`; ``bank_values`` whose rows, dtype,
            device or batch dims do not match the bank.
    """
    if bank_values is not None:
        check_tensor("bank_values", bank_values, min_dim=2)
    check_positive("alpha", alpha), check_positive("gamma", gamma)
    dropout_p = check_dropout_p(dropout_p)
    empty = _empty(z, templates, bank, bank_values, weights=False)
    if empty is not None:
        return empty
    zc, bank_c, u, log_k, mask, alpha, gamma, batch = _prepare(
        z, templates, bank, preference, cost, alpha, gamma, bank_mask
    )
    if bank_values is None:
        values = bank_c
    else:
        check_tensor("bank_values", bank_values, min_dim=2)
        if bank_values.shape[-2] != bank_c.shape[-2]:
            raise ValueError(
                f"bank_values must have m = {bank_c.shape[-2]} rows (one per bank member), "
                f"got {tuple(bank_values.shape)}"
            )
        if bank_values.dtype != z.dtype or bank_values.device != z.device:
            raise TypeError(f"bank_values must have the dtype/device of z ({z.dtype}, {z.device})")
        try:
            torch.broadcast_shapes(batch, bank_values.shape[:-2])
        except RuntimeError as exc:
            raise ValueError(
                f"bank_values batch dims {tuple(bank_values.shape[:-2])} do not broadcast with {batch}"
            ) from exc
        values = bank_values.to(zc.dtype)
    weights = torch.exp(ot_log_weights(zc, bank_c, u, log_k, alpha, gamma, mask))
    if dropout_p > 0.0:
        return dropout_attention(weights, values, dropout_p, z.dtype)
    return torch.matmul(weights, values).to(z.dtype)
