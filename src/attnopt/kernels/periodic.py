r"""Periodic ("Expsin", MacKay) kernel on the Euclidean distance (implicit-kernel-attention Table 2).

.. math:: k(q, k) = \exp\!\big(-2 \sin^2(\pi \|q - k\| / P) / l^2\big)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt.kernels._base import Kernel, dist, safe_norm

__all__ = ["Periodic"]


class Periodic(Kernel):
    """Periodic kernel with period ``P`` and length-scale ``l`` (positive, in (0, 1]).

    The distance ``‖q − k‖`` has a zero (finite) gradient at ``q = k``, where the kernel is
    flat.

    Args:
        period: ``P > 0``.
        lengthscale: ``l > 0``; ``None`` means ``l² = √d`` as for :class:`RBF`.
    Raises:
        ValueError: non-positive or non-finite ``period``/``lengthscale``.
    """

    squared = False

    def __init__(self, period: float, lengthscale: float | None = None) -> None:
        if not (math.isfinite(float(period)) and float(period) > 0):
            raise ValueError(f"period must be a finite number > 0, got {period}")
        if lengthscale is not None and not (math.isfinite(float(lengthscale)) and float(lengthscale) > 0):
            raise ValueError(f"lengthscale must be a finite number > 0, got {lengthscale}")
        self.period = float(period)
        self.lengthscale = None if lengthscale is None else float(lengthscale)

    def inv_sq_lengthscale(self, d: int) -> float:
        """``c = 1/l²`` for head dimension ``d`` (``1/√d`` by default)."""
        return 1.0 / math.sqrt(d) if self.lengthscale is None else 1.0 / self.lengthscale**2

    def _log_from_dist(self, r: Tensor, d: int) -> Tensor:
        # −2 sin²(πr/P)/l² = (cos(2πr/P) − 1)/l²: one transcendental per entry.
        return (torch.cos(r * (2.0 * math.pi / self.period)) - 1.0) * self.inv_sq_lengthscale(d)

    def log_gram(self, q: Tensor, k: Tensor) -> Tensor:
        """``−2 sin²(π‖q_i − k_j‖/P) / l²``: (..., Nq, Nk)."""
        self._check(q, k)
        return self._log_from_dist(dist(q, k), q.shape[-1])

    def __call__(self, q: Tensor, k: Tensor) -> Tensor:
        return self.log_gram(q, k).exp()

    def log_paired(self, x: Tensor, y: Tensor) -> Tensor:
        return self._log_from_dist(safe_norm((x - y).pow(2).sum(-1)), x.shape[-1])

    def __repr__(self) -> str:
        return f"Periodic(period={self.period}, lengthscale={self.lengthscale})"
