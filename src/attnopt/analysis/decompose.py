r"""Similarity × magnitude decomposition of attention scores (implicit-kernel-attention Prop. 1–2).

Prop. 1 (dot-product attention, scale ``s``; the paper has ``s = 1/\sqrt{d}``):

.. math:: e^{s\,q^\top k} = \underbrace{e^{-s\|q-k\|^2/2}}_{\text{similarity}}\,
          \underbrace{e^{s(\|q\|^2+\|k\|^2)/2}}_{\text{magnitude}}

Prop. 2 (GAT, LeakyReLU slope ``c`` chosen by the sign of the raw score
``e_{ij} = a^\top(q_i + k_j)`` with ``q_i = [Wh_i \| 0]``, ``k_j = [0 \| Wh_j]``):

.. math:: e^{c\,a^\top(q_i+k_j)} = e^{-\|q_i-ca\|^2/2}\, e^{-\|ca-k_j\|^2/2}\,
          e^{(2\|ca\|^2+\|q_i\|^2+\|k_j\|^2)/2}

Both functions return a :class:`Decomposition` ``(similarity, magnitude)``; with ``log=True``
the two fields hold the logarithms (use it when norms are large: the magnitude overflows
float32 once ``s(‖q‖²+‖k‖²)/2 > 88``). Half-precision inputs are computed and returned in
float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnopt._validation import check_attention_inputs, check_tensor, resolve_scale

__all__ = ["Decomposition", "decompose", "decompose_gat"]


class Decomposition(NamedTuple):
    """``similarity`` and ``magnitude``, each (..., Nq, Nk); their product is ``exp(score)``."""

    similarity: Tensor
    magnitude: Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _sqdist(a: Tensor, b: Tensor) -> Tensor:
    """Exact pairwise ``‖a_i − b_j‖²`` (difference first: no cancellation), (..., Na, Nb)."""
    return (a.unsqueeze(-2) - b.unsqueeze(-3)).pow(2).sum(-1)


def decompose(q: Tensor, k: Tensor, *, scale: float | None = None, log: bool = False) -> Decomposition:
    r"""Split ``exp(scale·qᵀk)`` into RBF similarity × exp-norm magnitude (Prop. 1).

    .. math:: \mathrm{sim}_{ij} = e^{-s\|q_i-k_j\|^2/2},\qquad
              \mathrm{mag}_{ij} = e^{s(\|q_i\|^2+\|k_j\|^2)/2}

    The similarity is the RBF kernel with length-scale ``l² = 1/s`` (``√d`` by default). The
    query part of the magnitude cancels in the row normalization of attention.

    Args:
        q: (..., Nq, d) queries.
        k: (..., Nk, d) keys (batch dimensions broadcast with ``q``).
        scale: ``s`` (default ``1/sqrt(d)``), must be > 0.
        log: return ``(log sim, log mag)`` instead (never overflows).
    Returns:
        :class:`Decomposition` of two (..., Nq, Nk) tensors (float32 for half inputs).
    Raises:
        TypeError: non-tensor or non-floating inputs.
        ValueError: mismatched shapes, ``scale <= 0``.
    """
    check_attention_inputs(q, k)
    s = resolve_scale(scale, q.shape[-1])
    dt = _compute_dtype(q)
    q, k = q.to(dt), k.to(dt)
    log_sim = -0.5 * s * _sqdist(q, k)
    log_mag = 0.5 * s * (q.pow(2).sum(-1).unsqueeze(-1) + k.pow(2).sum(-1).unsqueeze(-2))
    if log:
        return Decomposition(log_sim, log_mag)
    return Decomposition(log_sim.exp(), log_mag.exp())


def decompose_gat(
    x_q: Tensor, x_k: Tensor, att: Tensor, *, negative_slope: float = 0.2, log: bool = False
) -> Decomposition:
    r"""Split GAT's ``exp(LeakyReLU(aᵀ[Wh_i ‖ Wh_j]))`` into similarity × magnitude (Prop. 2).

    With ``q_i = [x_q,i ‖ 0]``, ``k_j = [0 ‖ x_k,j]`` and ``c_ij = 1`` if the raw score
    ``e_ij = aᵀ(q_i + k_j) ≥ 0`` else ``negative_slope``:

    .. math:: \mathrm{sim}_{ij} = e^{-\|q_i-c_{ij}a\|^2/2}\, e^{-\|c_{ij}a-k_j\|^2/2},\qquad
              \mathrm{mag}_{ij} = e^{(2\|c_{ij}a\|^2+\|q_i\|^2+\|k_j\|^2)/2}

    For PyTorch Geometric's ``GATConv`` (target node ``i`` attends to source ``j``):
    ``x_q = x_k = lin(x)`` per head and ``att = [att_dst ‖ att_src]``.

    Args:
        x_q: (..., Nq, F) transformed target features ``Wh_i``.
        x_k: (..., Nk, F) transformed source features ``Wh_j``.
        att: (..., 2F) the attention vector ``a`` (batch dims broadcast with ``x_q``'s,
            e.g. ``(H, 1, 2F)``-style per-head vectors as ``(H, 2F)`` with x of shape (H, N, F)).
        negative_slope: LeakyReLU slope for negative raw scores (> 0).
        log: return logarithms.
    Returns:
        :class:`Decomposition` of two (..., Nq, Nk) tensors.
    Raises:
        TypeError: non-tensor or non-floating inputs.
        ValueError: feature sizes that do not match, ``negative_slope <= 0``.
    """
    check_attention_inputs(x_q, x_k)
    check_tensor("att", att)
    f = x_q.shape[-1]
    if att.shape[-1] != 2 * f:
        raise ValueError(f"att must have last dimension 2F = {2 * f}, got {tuple(att.shape)}")
    if not negative_slope > 0:
        raise ValueError(f"negative_slope must be > 0, got {negative_slope}")
    dt = _compute_dtype(x_q)
    x_q, x_k, att = x_q.to(dt), x_k.to(dt), att.to(dt)
    a_q, a_k = att[..., :f].unsqueeze(-2), att[..., f:].unsqueeze(-2)  # (..., 1, F)
    raw = (x_q * a_q).sum(-1).unsqueeze(-1) + (x_k * a_k).sum(-1).unsqueeze(-2)  # (..., Nq, Nk)
    c = torch.where(raw >= 0, torch.ones_like(raw), torch.full_like(raw, negative_slope))
    # ‖q_i − c a‖² = ‖x_q,i − c a_q‖² + c²‖a_k‖²;  ‖c a − k_j‖² = c²‖a_q‖² + ‖c a_k − x_k,j‖².
    aq2, ak2 = a_q.pow(2).sum(-1).unsqueeze(-1), a_k.pow(2).sum(-1).unsqueeze(-1)  # (..., 1, 1)
    xq2, xk2 = x_q.pow(2).sum(-1).unsqueeze(-1), x_k.pow(2).sum(-1).unsqueeze(-2)
    qa = (x_q * a_q).sum(-1).unsqueeze(-1)
    ka = (x_k * a_k).sum(-1).unsqueeze(-2)
    d_q = xq2 - 2 * c * qa + c.pow(2) * aq2 + c.pow(2) * ak2
    d_k = c.pow(2) * aq2 + c.pow(2) * ak2 - 2 * c * ka + xk2
    log_sim = -0.5 * (d_q + d_k)
    log_mag = 0.5 * (2 * c.pow(2) * (aq2 + ak2) + xq2 + xk2)
    if log:
        return Decomposition(log_sim, log_mag)
    return Decomposition(log_sim.exp(), log_mag.exp())
