r"""RBF (squared-exponential) kernel: the similarity inside dot-product attention (Prop. 1).

.. math:: k(q, k) = \exp\!\big(-\|q - k\|^2 / (2 l^2)\big)

With ``l² = √d`` (the default) and the L2 magnitude, kernel attention equals SDPA.
"""
from __future__ import annotations

import math

from torch import Tensor

from attnopt.kernels._base import Kernel, sqdist

__all__ = ["RBF"]


class RBF(Kernel):
    """RBF kernel with length-scale ``l`` (positive; no finite feature map).

    Args:
        lengthscale: ``l > 0``; ``None`` means ``l² = √d`` with ``d`` the input dimension,
            the length-scale implicit in scaled dot-product attention.
    Raises:
        ValueError: ``lengthscale <= 0`` or not finite.
    """

    squared = False

    def __init__(self, lengthscale: float | None = None) -> None:
        if lengthscale is not None and not (math.isfinite(float(lengthscale)) and float(lengthscale) > 0):
            raise ValueError(f"lengthscale must be a finite number > 0, got {lengthscale}")
        self.lengthscale = None if lengthscale is None else float(lengthscale)

    def inv_sq_lengthscale(self, d: int) -> float:
        """``1 / l²`` for inputs of dimension ``d``."""
        if self.lengthscale is None:
            return 1.0 / math.sqrt(d)
        return 1.0 / self.lengthscale**2

    def log_gram(self, q: Tensor, k: Tensor) -> Tensor:
        """``−‖q_i − k_j‖² / (2l²)``: (..., Nq, Nk)."""
        self._check(q, k)
        return -0.5 * self.inv_sq_lengthscale(q.shape[-1]) * sqdist(q, k)

    def __call__(self, q: Tensor, k: Tensor) -> Tensor:
        return self.log_gram(q, k).exp()

    def log_paired(self, x: Tensor, y: Tensor) -> Tensor:
        return -0.5 * self.inv_sq_lengthscale(x.shape[-1]) * (x - y).pow(2).sum(-1)

    def __repr__(self) -> str:
        return f"RBF(lengthscale={self.lengthscale})"
