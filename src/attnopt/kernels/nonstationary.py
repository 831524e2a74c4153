r"""Non-stationary random-Fourier kernel (implicit-kernel-attention eq. 14–16, Prop. 4).

.. math:: f(q, k) = \frac1{4R} \sum_{r=1}^R \phi_r(q)^\top \phi_r(k),\qquad
          \phi_r(x) = \begin{pmatrix} \cos w_{1,r}^\top x + \cos w_{2,r}^\top x \\
                                      \sin w_{1,r}^\top x + \sin w_{2,r}^\top x \end{pmatrix}

``f`` can be negative, so attention uses ``f²``. With ``w_1 = w_2`` it is the stationary
:class:`~attnopt.kernels.RandomFourier` kernel.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt.kernels._base import Kernel, check_dim, check_spectral_points

__all__ = ["NonStationaryFourier"]


class NonStationaryFourier(Kernel):
    """Non-stationary kernel given by two sets of ``R`` spectral points.

    Args:
        w1, w2: (..., R, d) each, the same shape; leading dimensions broadcast against the
            batch dimensions of the inputs.
    Raises:
        TypeError: not floating tensors.
        ValueError: shapes differ, fewer than 2 dimensions, non-finite entries.
    """

    squared = True
    has_features = True
    bounded = True  # |f| ≤ 1: a mean of cosines

    _stacked: Tensor | None = None  # w1 and w2 as one (..., 2R, d) tensor (see stacked())
    _w1: Tensor | None = None
    _w2: Tensor | None = None

    def __init__(self, w1: Tensor, w2: Tensor) -> None:
        self._w1 = check_spectral_points("w1", w1)
        self._w2 = check_spectral_points("w2", w2)
        if w1.shape != w2.shape:
            raise ValueError(f"w1 and w2 must have the same shape, got {tuple(w1.shape)}, {tuple(w2.shape)}")

    @property
    def w1(self) -> Tensor:
        """The first set (..., R, d) (of a :meth:`stacked` kernel: a view, made on first use)."""
        if self._w1 is None:
            assert self._stacked is not None
            self._w1 = self._stacked.narrow(-2, 0, self._stacked.shape[-2] // 2)
        return self._w1

    @property
    def w2(self) -> Tensor:
        """The second set (..., R, d)."""
        if self._w2 is None:
            assert self._stacked is not None
            r = self._stacked.shape[-2] // 2
            self._w2 = self._stacked.narrow(-2, r, r)
        return self._w2

    @classmethod
    def stacked(cls, points: Tensor) -> NonStationaryFourier:
        """The kernel of ``w1 = points[..., :R, :]``, ``w2 = points[..., R:, :]`` (``points (..., 2R, d)``).

        One finiteness check (a C bit test, :func:`attnopt._validation.any_nonfinite`), and
        attention uses ``points`` as they are (no concatenation; ``w1``/``w2`` views on first use).

        Raises:
            TypeError, ValueError: as the constructor; an odd number of points.
        """
        points = check_spectral_points("points", points)
        if points.shape[-2] % 2:
            raise ValueError(f"points must hold 2R rows (w1 then w2), got {tuple(points.shape)}")
        out = cls.__new__(cls)
        out._stacked = points  # the sets' views are made when asked for (attention takes `points`)
        return out

    def fourier_stack(self) -> tuple[Tensor, int, float] | None:
        if self._stacked is None:
            return super().fourier_stack()
        return self._stacked, 2, 1.0 / (2 * math.sqrt(self.num_samples))

    @property
    def num_samples(self) -> int:
        """``R``."""
        if self._stacked is not None:
            return int(self._stacked.shape[-2]) // 2
        return int(self.w1.shape[-2])

    @classmethod
    def gaussian(
        cls,
        num_samples: int,
        dim: int,
        std1: float,
        std2: float,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NonStationaryFourier:
        """Independent ``w_1 ~ N(0, std1² I)``, ``w_2 ~ N(0, std2² I)`` (Prop. 4 setting).

        Raises:
            ValueError: ``num_samples``/``dim`` < 1 or negative stds.
        """
        if num_samples < 1 or dim < 1:
            raise ValueError(f"num_samples and dim must be >= 1, got {num_samples}, {dim}")
        if std1 < 0 or std2 < 0:
            raise ValueError(f"std1 and std2 must be >= 0, got {std1}, {std2}")
        w1 = torch.randn(num_samples, dim, generator=generator, dtype=dtype, device=device) * std1
        w2 = torch.randn(num_samples, dim, generator=generator, dtype=dtype, device=device) * std2
        return cls(w1, w2)

    def features(self, x: Tensor) -> Tensor:
        """``φ(x)/(2√R)``: (..., N, 2R), so ``f = φ(q)ᵀφ(k)``."""
        check_dim("w1", self.w1, x)
        p1 = torch.matmul(x, self.w1.to(x.dtype).transpose(-2, -1))
        p2 = torch.matmul(x, self.w2.to(x.dtype).transpose(-2, -1))
        phi = torch.cat([p1.cos() + p2.cos(), p1.sin() + p2.sin()], dim=-1)
        return phi / (2 * math.sqrt(self.num_samples))

    def fourier_sets(self) -> tuple[list[Tensor], float]:
        return [self.w1, self.w2], 1.0 / (2 * math.sqrt(self.num_samples))

    def __call__(self, q: Tensor, k: Tensor) -> Tensor:
        self._check(q, k)
        return torch.matmul(self.features(q), self.features(k).transpose(-2, -1))

    def _paired_features(self, x: Tensor) -> Tensor:
        """``φ(x_n)/(2√R)`` per row (..., d) -> (..., 2R), by einsum (no broadcast matmul)."""
        check_dim("w1", self.w1, x)
        p1 = torch.einsum("...d,...rd->...r", x, self.w1.to(x.dtype))
        p2 = torch.einsum("...d,...rd->...r", x, self.w2.to(x.dtype))
        phi = torch.cat([p1.cos() + p2.cos(), p1.sin() + p2.sin()], dim=-1)
        return phi / (2 * math.sqrt(self.num_samples))

    def paired(self, x: Tensor, y: Tensor) -> Tensor:
        return (self._paired_features(x) * self._paired_features(y)).sum(-1)

    def __repr__(self) -> str:
        return f"NonStationaryFourier(w={tuple(self.w1.shape)})"
