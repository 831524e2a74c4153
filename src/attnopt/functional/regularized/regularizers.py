r"""Convex regularizers ``Ω`` of the simplex and their prediction maps (sdpa-one-sided-eot §4).

A regularizer defines the map

.. math:: \nabla\Omega^*(s) = \arg\max_{p \in \Delta} \langle s, p\rangle - \Omega(p),

* :class:`Shannon` ``(τ)``: ``Ω = τ Σ p log p`` ⇒ ``softmax(s/τ)`` (Thm 3.3, Prop. 4.1);
* :class:`SquaredL2`: ``Ω = ½‖p‖²`` ⇒ sparsemax ``[s − θ]₊`` (Prop. 4.2);
* :class:`Tsallis` ``(α)``: ``Ω = Σ (p^α − p)/(α(α−1))`` ⇒ α-entmax (Prop. 4.3).

A user regularizer is any object with ``conjugate_grad(scores, dim) -> weights`` (the map
``∇Ω*``) — see :class:`Regularizer`; give it a ``value(p, dim) -> Ω(p)`` method too to check it
with :func:`attnopt.dual.solve_regularized`. The locality term of Prop. 4.4 (ALiBi) is linear
in ``p``, so it is not a regularizer here but a score offset: see ``locality=`` of
:func:`attnopt.functional.regularized_attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from attnopt.functional._softmax import safe_softmax
from attnopt.functional.regularized._maps import entmax, sparsemax

__all__ = ["Regularizer", "Shannon", "SquaredL2", "Tsallis"]


@runtime_checkable
class Regularizer(Protocol):
    """What :func:`attnopt.functional.regularized_weights` needs from a regularizer.

    ``conjugate_grad(scores, dim)`` returns ``∇Ω*(scores) = argmax_{p∈Δ} <s,p> − Ω(p)`` along
    ``dim`` (non-negative, summing to one; ``-inf`` scores must get 0). It should be
    differentiable (autograd or a custom backward) if gradients are needed.
    """

    def conjugate_grad(self, scores: Tensor, dim: int) -> Tensor:
        """The prediction map ``∇Ω*(scores)`` along ``dim``."""
        ...


@dataclass(frozen=True)
class Shannon:
    r"""Shannon negentropy ``Ω(p) = τ Σ_j p_j log p_j`` (one-sided entropic OT, Thm 3.3).

    Map: ``softmax(s / τ)``; with scores ``<q,k>`` and ``τ = √d`` this is SDPA.

    Args:
        temperature: ``τ > 0`` (default 1).
    Raises:
        ValueError: ``temperature`` not a finite number > 0.
    """

    temperature: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")

    def value(self, p: Tensor, dim: int = -1) -> Tensor:
        """``τ Σ p log p`` along ``dim`` (``0 log 0 = 0``)."""
        return self.temperature * torch.special.xlogy(p, p).sum(dim=dim)

    def conjugate_grad(self, scores: Tensor, dim: int = -1) -> Tensor:
        """``softmax(scores / τ)``; an all ``-inf`` slice gives zeros."""
        s = scores if self.temperature == 1.0 else scores / self.temperature
        return safe_softmax(s, dim=dim)


@dataclass(frozen=True)
class SquaredL2:
    r"""``Ω(p) = ½‖p‖²`` (Prop. 4.2); map: sparsemax ``[s − θ]₊``."""

    def value(self, p: Tensor, dim: int = -1) -> Tensor:
        """``½ Σ p²`` along ``dim``."""
        return 0.5 * (p * p).sum(dim=dim)

    def conjugate_grad(self, scores: Tensor, dim: int = -1) -> Tensor:
        """:func:`attnopt.functional.sparsemax`."""
        return sparsemax(scores, dim=dim)


@dataclass(frozen=True, eq=False)
class Tsallis:
    r"""Tsallis negentropy ``Ω(p) = Σ_j (p_j^α − p_j) / (α(α−1))`` (Prop. 4.3), any ``α > 0``.

    Map: α-entmax ``[(α−1)s − θ]₊^{1/(α−1)}``; ``α = 2`` is sparsemax, ``α = 1`` is the
    limit ``Ω(p) = Σ p log p`` (Shannon, map softmax), ``α ∈ (0, 1)`` gives dense maps.

    Args:
        alpha: a float > 0, or a tensor of values > 0 broadcastable to the scores with size 1
            along the normalized dim (e.g. ``(H, 1, 1)`` per head; it then receives gradients).
    Raises:
        ValueError: ``alpha <= 0`` or not finite.
        TypeError: ``alpha`` is neither a number nor a floating-point tensor.
    """

    alpha: float | Tensor = 1.5

    def __post_init__(self) -> None:
        a = self.alpha
        if isinstance(a, Tensor):
            if not a.is_floating_point():
                raise TypeError(f"alpha must be a floating-point tensor, got {a.dtype}")
            if not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
                raise ValueError("alpha must be finite and > 0")
            return
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"alpha must be a float or a tensor, got {type(a).__name__}")
        if not math.isfinite(a) or a <= 0:
            raise ValueError(f"alpha must be a finite number > 0, got {a}")
        object.__setattr__(self, "alpha", float(a))

    def value(self, p: Tensor, dim: int = -1) -> Tensor:
        """``Σ (p^α − p) / (α(α−1))`` along ``dim`` (``Σ p log p`` where ``α = 1``)."""
        a = self.alpha
        p = p.clamp_min(0)
        shannon = torch.special.xlogy(p, p)
        if not isinstance(a, Tensor):
            return (shannon if a == 1.0 else (p**a - p) / (a * (a - 1))).sum(dim=dim)
        one = a == 1
        safe = torch.where(one, torch.full_like(a, 2.0), a)  # no 0/0 in the unused branch
        return torch.where(one, shannon, (p**safe - p) / (safe * (safe - 1))).sum(dim=dim)

    def conjugate_grad(self, scores: Tensor, dim: int = -1) -> Tensor:
        """:func:`attnopt.functional.regularized.entmax` with this ``alpha``."""
        return entmax(scores, self.alpha, dim=dim)
