r"""Linear kernel (implicit-kernel-attention Table 2, "Linear").

.. math:: f(q, k) = s\, q^\top k

It can be negative, so attention uses ``f²`` (``squared = True``); its feature map is
``φ(x) = √s x``.
"""
from __future__ import annotations

import math

from torch import Tensor

from attnopt.kernels._base import Kernel

__all__ = ["Linear"]


class Linear(Kernel):
    """Linear kernel ``s·qᵀk``.

    Args:
        scale: ``s > 0``; ``None`` means ``1/√d``.
    Raises:
        ValueError: ``scale <= 0`` or not finite.
    """

    squared = True
    has_features = True

    def __init__(self, scale: float | None = None) -> None:
        if scale is not None and not (math.isfinite(float(scale)) and float(scale) > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        self.scale = None if scale is None else float(scale)

    def _s(self, d: int) -> float:
        return 1.0 / math.sqrt(d) if self.scale is None else self.scale

    def features(self, x: Tensor) -> Tensor:
        """``√s x``: (..., N, d)."""
        return x * math.sqrt(self._s(x.shape[-1]))

    def __call__(self, q: Tensor, k: Tensor) -> Tensor:
        self._check(q, k)
        return self._s(q.shape[-1]) * q.matmul(k.transpose(-2, -1))

    def paired(self, x: Tensor, y: Tensor) -> Tensor:
        return self._s(x.shape[-1]) * (x * y).sum(-1)

    def __repr__(self) -> str:
        return f"Linear(scale={self.scale})"
