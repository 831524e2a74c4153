"""Fenchel–Young loss modules: :class:`SparsemaxLoss`, :class:`EntmaxLoss` (every α > 0)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnopt.functional.regularized.losses import Reduction, entmax_loss, sparsemax_loss

__all__ = ["EntmaxLoss", "SparsemaxLoss"]


class SparsemaxLoss(nn.Module):
    """:func:`attnopt.functional.regularized.losses.sparsemax_loss` as a module (``cross_entropy``-like).

    Args:
        reduction: ``"none"`` | ``"mean"`` | ``"sum"``.
        ignore_index: class index whose samples are ignored (class-index targets).
    """

    def __init__(self, *, reduction: Reduction = "mean", ignore_index: int = -100) -> None:
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, scores: Tensor, target: Tensor) -> Tensor:
        """Loss of ``scores (N, C, …)`` against class indices or probabilities."""
        return sparsemax_loss(scores, target, reduction=self.reduction, ignore_index=self.ignore_index)


class EntmaxLoss(nn.Module):
    """:func:`attnopt.functional.regularized.losses.entmax_loss` as a module.

    Args:
        alpha: a float > 0 (``1`` = cross-entropy, ``1.5`` default, ``2`` = sparsemax loss), or a
            tensor of one α per sample.
        learn_alpha: learn one scalar α with the model, as ``α = softplus(ρ)`` (> 0 always;
            ``ρ`` initialized so that α starts at ``alpha``).
        reduction: ``"none"`` | ``"mean"`` | ``"sum"``.
        ignore_index: class index whose samples are ignored (class-index targets).
    Raises:
        ValueError: ``alpha`` not > 0, a bad ``reduction``.
    """

    def __init__(
        self,
        alpha: float | Tensor = 1.5,
        *,
        learn_alpha: bool = False,
        reduction: Reduction = "mean",
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        if isinstance(alpha, Tensor):
            ok = alpha.is_floating_point() and bool((alpha > 0).all()) and bool(torch.isfinite(alpha).all())
            if not ok:
                raise ValueError("alpha must be a floating tensor of finite values > 0")
        elif isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        self.reduction, self.ignore_index = reduction, ignore_index
        self.learn_alpha = learn_alpha
        if learn_alpha:
            a = torch.as_tensor(alpha, dtype=torch.get_default_dtype())
            if a.dim() != 0:
                raise ValueError("learn_alpha=True learns one scalar alpha; pass a float")
            self.rho = nn.Parameter(a.expm1().log())  # softplus^{-1}(alpha)
        else:
            self.alpha = alpha

    def current_alpha(self) -> float | Tensor:
        """α used by :meth:`forward` (``softplus(ρ)`` when learned)."""
        return nn.functional.softplus(self.rho) if self.learn_alpha else self.alpha

    def forward(self, scores: Tensor, target: Tensor) -> Tensor:
        """Loss of ``scores (N, C, …)`` against class indices or probabilities."""
        a = self.current_alpha()
        if isinstance(a, Tensor):
            a = a.to(scores.dtype)
        return entmax_loss(scores, target, a, reduction=self.reduction, ignore_index=self.ignore_index)
