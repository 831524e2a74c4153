r"""Sparse probability maps as layers: :class:`Sparsemax`, :class:`Entmax15`, :class:`EntmaxBisect`.

The ``entmax`` package's modules under the same names and signatures (``Sparsemax(dim)``,
``Entmax15(dim)``, ``EntmaxBisect(alpha, dim)``), so that its users switch by changing the
import; each is a thin wrapper of :func:`attnopt.sparsemax` / :func:`attnopt.entmax`, the
regularized argmax of sdpa-one-sided-eot Prop. 4.2–4.3:

.. math:: p = \arg\max_{p \in \Delta} \langle s, p \rangle - \Omega_\alpha(p), \qquad
          \Omega_\alpha(p) = \frac{1}{\alpha(\alpha - 1)} \sum_j (p_j^\alpha - p_j)

(``α = 2``: sparsemax, ``½‖p‖²``; ``α → 1``: softmax). Not taken: the package's ``k``
(partial-sort) and ``n_iter`` knobs; the thresholds here are found without sorting, to
``tol`` / ``max_iter`` (keyword-only).
"""
from __future__ import annotations

from torch import Tensor, nn

from attnopt.functional.regularized import entmax, sparsemax

__all__ = ["Entmax15", "EntmaxBisect", "Sparsemax"]


class Sparsemax(nn.Module):
    """``sparsemax(x, dim)`` as a module (sdpa-one-sided-eot Prop. 4.2).

    Args:
        dim: dimension that sums to one.
    Shapes: any ``(..., S, ...)`` -> the same shape.
    Raises:
        ValueError, TypeError: as :func:`attnopt.sparsemax` (at call time).
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return sparsemax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Entmax15(nn.Module):
    """``entmax(x, 1.5, dim)`` as a module (sdpa-one-sided-eot Prop. 4.3; exact threshold).

    Args:
        dim: dimension that sums to one.
    Raises:
        ValueError, TypeError: as :func:`attnopt.entmax` (at call time).
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return entmax(x, 1.5, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class EntmaxBisect(nn.Module):
    """``entmax(x, alpha, dim)`` for any ``α > 0`` as a module (sdpa-one-sided-eot Prop. 4.3).

    Args:
        alpha: ``α > 0``: a float, or a tensor (per row / per head, size 1 along ``dim``; it
            receives a gradient: wrap it in ``nn.Parameter`` to learn it).
        dim: dimension that sums to one.
        tol, max_iter: stopping rule of the threshold search (see :func:`attnopt.entmax`).
    Raises:
        ValueError, TypeError: as :func:`attnopt.entmax` (at call time).
    """

    def __init__(self, alpha: float | Tensor = 1.5, dim: int = -1, *, tol: float | None = None,
                 max_iter: int = 100) -> None:
        super().__init__()
        self.alpha, self.dim, self.tol, self.max_iter = alpha, dim, tol, max_iter

    def forward(self, x: Tensor) -> Tensor:
        return entmax(x, self.alpha, self.dim, tol=self.tol, max_iter=self.max_iter)

    def extra_repr(self) -> str:
        alpha = self.alpha if not isinstance(self.alpha, Tensor) else f"tensor{tuple(self.alpha.shape)}"
        return f"alpha={alpha}, dim={self.dim}"
