r"""The backward pass of attention as a policy gradient (sdpa-one-sided-eot §5–7).

With weights ``p = softmax(s/τ)`` (scores ``s``, temperature ``τ``) and a downstream loss
``L``, the *utilities* are ``U = −∂L/∂p`` and the *advantages* ``A = U − <p, U>``. Then

* Thm 5.2: ``∂L/∂s = −(1/τ) p ⊙ A`` (REINFORCE with the expected-value baseline);
* Thm 7.3: with the Fisher matrix ``F = (diag p − ppᵀ)/τ²``, ``∂L/∂s = −τ F U``;
* Cor. 7.5: the Hessian of the dual potential ``τ·logsumexp(s/τ)`` is ``τ F``.

:func:`policy_view` checks the first two against autograd for any attention layer whose raw
scores and weights are in the autograd graph of a loss; :func:`policy_probe` provides them for
a Hugging Face BERT-family model (e.g. the bundled MiniLM) by registering an attention function
that records, per layer, the raw scores ``s = q kᵀ`` (so ``τ = 1/scaling = √d``, the paper's
convention) and the weights. :func:`logsumexp_hessian` checks Cor. 7.5.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "fisher_matrix",
    "advantages",
    "policy_gradient",
    "natural_gradient_form",
    "logsumexp_hessian",
    "PolicyView",
    "policy_view",
    "PolicyRecord",
    "policy_probe",
]


def _rel(a: Tensor, b: Tensor) -> float:
    """``max|a − b| / max|b|`` (0 when both vanish)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    return err / scale if scale > 0 else err


def fisher_matrix(weights: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Fisher information of ``p = softmax(s/τ)`` w.r.t. ``s``: ``F = (diag p − p pᵀ)/τ²`` (Thm 7.3).

    Args:
        weights: (..., n) rows on the simplex (last dim).
        temperature: ``τ > 0``.
    Returns:
        (..., n, n) symmetric positive semi-definite matrices.
    Raises:
        ValueError: ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    p = weights
    return (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) / temperature**2


def advantages(weights: Tensor, utilities: Tensor) -> Tensor:
    """``A = U − <p, U>`` along the last dim (the expected-utility baseline removed)."""
    return utilities - (weights * utilities).sum(-1, keepdim=True)


def policy_gradient(weights: Tensor, utilities: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Thm 5.2: ``∂L/∂s = −(1/τ) p ⊙ (U − <p, U>)``."""
    return -(weights * advantages(weights, utilities)) / temperature


def natural_gradient_form(weights: Tensor, utilities: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Thm 7.3: ``∂L/∂s = −τ F U`` with the explicit Fisher matrix (materializes ``n × n``)."""
    fisher = fisher_matrix(weights, temperature=temperature)
    return -temperature * (fisher @ utilities.unsqueeze(-1)).squeeze(-1)


def logsumexp_hessian(scores: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Autograd Hessian of the dual potential ``φ(s) = τ·logsumexp(s/τ)`` per row (Cor. 7.5).

    Args:
        scores: (..., n) finite scores (rows on the last dim).
    Returns:
        (..., n, n); equals ``τ F(softmax(s/τ))`` by Cor. 7.5.
    """
    flat = scores.reshape(-1, scores.shape[-1])

    def phi(row: Tensor) -> Tensor:
        return temperature * torch.logsumexp(row / temperature, dim=-1)

    hess = torch.func.vmap(torch.func.hessian(phi))(flat)
    return hess.reshape(*scores.shape, scores.shape[-1])


@dataclass(frozen=True)
class PolicyView:
    """Policy-gradient view of one attention layer (all tensors ``(..., Nq, Nk)``).

    Attributes:
        weights: ``p``.
        utilities: ``U = −∂L/∂p``.
        advantages: ``U − <p, U>``.
        score_grad: autograd's ``∂L/∂s``.
        thm52_grad: ``−(1/τ) p ⊙ A`` (Thm 5.2).
        thm73_grad: ``−τ F U`` (Thm 7.3).
        thm52_rel_err, thm73_rel_err: ``max|formula − autograd| / max|autograd|``.
        temperature: ``τ``.
    """

    weights: Tensor
    utilities: Tensor
    advantages: Tensor
    score_grad: Tensor
    thm52_grad: Tensor
    thm73_grad: Tensor
    thm52_rel_err: float
    thm73_rel_err: float
    temperature: float


def policy_view(
    scores: Tensor, weights: Tensor, loss: Tensor, *, temperature: float = 1.0, retain_graph: bool = True
) -> PolicyView:
    r"""Utilities, advantages and the Thm 5.2 / 7.3 gradients of one attention layer.

    Args:
        scores: the raw scores ``s`` (..., Nq, Nk), a node of the autograd graph of ``loss``.
        weights: ``p = softmax(s/τ + mask)`` computed from ``scores`` (same shape), also in the graph.
        loss: scalar loss downstream of ``weights``.
        temperature: ``τ`` with which ``weights`` were computed from ``scores``.
        retain_graph: keep the graph (to analyze several layers of one loss).
    Returns:
        :class:`PolicyView` with autograd's ``∂L/∂s`` next to both formulas and their errors.
    Raises:
        ValueError: shapes differ, ``loss`` is not a scalar, or ``temperature <= 0``.
    """
    if scores.shape != weights.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and weights {tuple(weights.shape)} must match")
    if loss.dim() != 0:
        raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    grad_s, grad_p = torch.autograd.grad(loss, [scores, weights], retain_graph=retain_graph)
    p = weights.detach()
    u = -grad_p
    f52 = policy_gradient(p, u, temperature=temperature)
    f73 = natural_gradient_form(p, u, temperature=temperature)
    return PolicyView(
        weights=p,
        utilities=u,
        advantages=advantages(p, u),
        score_grad=grad_s,
        thm52_grad=f52,
        thm73_grad=f73,
        thm52_rel_err=_rel(f52, grad_s),
        thm73_rel_err=_rel(f73, grad_s),
        temperature=temperature,
    )


@dataclass(frozen=True)
class PolicyRecord:
    """Raw scores ``s = q kᵀ`` and weights ``softmax(s/τ + mask)`` of one layer call."""

    module: Any
    scores: Tensor
    weights: Tensor
    temperature: float


@contextmanager
def policy_probe(model: Any, *, name: str = "attnopt_policy_probe") -> Iterator[list[PolicyRecord]]:
    """Record the raw scores and weights of every attention call of a Hugging Face model.

    Registers an attention function (``transformers.AttentionInterface``, with the eager
    additive mask in ``AttentionMaskInterface``) that computes the
    eager attention from the raw scores ``s = q kᵀ`` with ``τ = 1/scaling`` (``√d``), appends a
    :class:`PolicyRecord` per call, and switches ``model`` to it for the duration of the block.
    Dropout is not applied (use ``model.eval()``).

    Yields:
        the list of records, filled by each forward pass.
    Raises:
        ImportError: ``transformers`` is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    records: list[PolicyRecord] = []

    def attention(
        module: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,  # noqa: ARG001 - eval only
        **kwargs: Any,  # noqa: ARG001 - the interface passes extra keywords
    ) -> tuple[Tensor, Tensor]:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        raw = torch.matmul(query, key.transpose(-2, -1))
        logits = raw * scale
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attention_mask, float("-inf"))
        elif attention_mask is not None:
            logits = logits + attention_mask
        weights = torch.softmax(logits, dim=-1)
        records.append(PolicyRecord(module, raw, weights, 1.0 / scale))
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return out, weights

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)  # without it the padding mask is dropped
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield records
    finally:
        model.set_attn_implementation(previous)
