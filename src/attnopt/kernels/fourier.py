r"""Stationary random-Fourier kernel (implicit-kernel-attention eq. 12–13, Prop. 3).

.. math:: f(q, k) = \frac1R \sum_{r=1}^R \phi_r(q)^\top \phi_r(k)
          = \frac1R \sum_r \cos\big(w_r^\top (q - k)\big),\qquad
          \phi_r(x) = (\cos w_r^\top x,\ \sin w_r^\top x)

``f`` can be negative, so attention uses ``f²`` (Prop. 3: with ``w ~ N(0, I/(2l²))``,
``f² → exp(−‖q−k‖²/(2l²))`` as ``R → ∞``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt.kernels._base import Kernel, check_dim, check_spectral_points

__all__ = ["RandomFourier"]


class RandomFourier(Kernel):
    """Stationary kernel given by ``R`` spectral points.

    Args:
        spectral_points: ``w`` of shape (..., R, d); leading dimensions broadcast against the
            batch dimensions of the inputs (e.g. (H, R, d) per head, (B, H, R, d) per sample).
            May require grad (learned or reparameterized points).
    Raises:
        TypeError: not a floating tensor.
        ValueError: fewer than 2 dimensions, or non-finite entries.
    """

    squared = True
    has_features = True
    bounded = True  # |f| ≤ 1: a mean of cosines

    def __init__(self, spectral_points: Tensor) -> None:
        self.spectral_points = check_spectral_points("spectral_points", spectral_points)

    @property
    def num_samples(self) -> int:
        """``R``."""
        return int(self.spectral_points.shape[-2])

    @classmethod
    def rbf(
        cls,
        num_samples: int,
        dim: int,
        lengthscale: float | None = None,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> RandomFourier:
        """Spectral points ``w ~ N(0, I/(2l²))`` (Prop. 3), so ``f² ≈ RBF(l)``; ``l² = √dim`` if None.

        Raises:
            ValueError: ``num_samples`` or ``dim`` < 1, ``lengthscale <= 0``.
        """
        if num_samples < 1 or dim < 1:
            raise ValueError(f"num_samples and dim must be >= 1, got {num_samples}, {dim}")
        l2 = math.sqrt(dim) if lengthscale is None else float(lengthscale) ** 2
        if not l2 > 0:
            raise ValueError(f"lengthscale must be > 0, got {lengthscale}")
        w = torch.randn(num_samples, dim, generator=generator, dtype=dtype, device=device)
        return cls(w / math.sqrt(2 * l2))

    def features(self, x: Tensor) -> Tensor:
        """``φ(x)/√R = [cos(xwᵀ), sin(xwᵀ)]/√R``: (..., N, 2R), so ``f = φ(q)ᵀφ(k)``."""
        w = self.spectral_points
        check_dim("spectral_points", w, x)
        proj = torch.matmul(x, w.to(x.dtype).transpose(-2, -1))
        return torch.cat([proj.cos(), proj.sin()], dim=-1) / math.sqrt(self.num_samples)

    def fourier_sets(self) -> tuple[list[Tensor], float]:
        return [self.spectral_points], 1.0 / math.sqrt(self.num_samples)

    def __call__(self, q: Tensor, k: Tensor) -> Tensor:
        self._check(q, k)
        return torch.matmul(self.features(q), self.features(k).transpose(-2, -1))

    def paired(self, x: Tensor, y: Tensor) -> Tensor:
        w = self.spectral_points
        check_dim("spectral_points", w, x)
        # cos a cos b + sin a sin b = cos(a − b): one einsum over the differences
        diff = torch.einsum("...d,...rd->...r", x - y, w.to(x.dtype))
        return diff.cos().mean(-1)

    def __repr__(self) -> str:
        return f"RandomFourier(spectral_points={tuple(self.spectral_points.shape)})"
