"""The `entmax` package's public names, mapped onto attnopt, so its own tests run against us.

Test-only (not shipped). Each name takes the package's signature and calls attnopt:

=======================================  =====================================================
entmax name                              attnopt
=======================================  =====================================================
``sparsemax``, ``sparsemax_bisect``,     :func:`attnopt.sparsemax` (exact; ``k`` / ``n_iter`` /
``Sparsemax``                            ``ensure_sum_one`` are algorithm knobs of the package
                                         that do not change the result: accepted, unused)
``entmax15``, ``Entmax15``               :func:`attnopt.entmax` with ``alpha=1.5``
``entmax_bisect``, ``EntmaxBisect``      :func:`attnopt.entmax` (every α > 0, tensor α)
``SparsemaxLoss``, ``SparsemaxBisectLoss``  :class:`attnopt.nn.SparsemaxLoss`
``Entmax15Loss``, ``EntmaxBisectLoss``   :class:`attnopt.nn.EntmaxLoss` (``"elementwise_mean"`` is
                                         ``"mean"``)
=======================================  =====================================================

Out of scope (their tests are *skipped* with the reason, not failed): ``normmax_bisect`` /
``NormmaxBisectLoss`` (the normmax map, a different regularizer, ‖p‖_α, not in the papers
attnopt implements), ``budget_bisect`` (the budget-constrained map), and the package's
``test_topk.py`` (tests the private partial-sort helpers ``_sparsemax_threshold_and_support``
behind the ``k`` knob; attnopt has no partial sort — its thresholds are exact by Newton /
Michelot — so there is nothing of ours for those tests to call).
"""
from __future__ import annotations

from typing import Any

import pytest
from torch import Tensor, nn

import attnopt
from attnopt import nn as ann

__all__ = [
    "sparsemax", "entmax15", "sparsemax_bisect", "entmax_bisect", "normmax_bisect", "budget_bisect",
    "Sparsemax", "Entmax15", "EntmaxBisect",
    "SparsemaxLoss", "Entmax15Loss", "SparsemaxBisectLoss", "EntmaxBisectLoss",
    "NormmaxBisectLoss",
]

OUT_OF_SCOPE = {
    "normmax": "normmax (‖p‖_α-regularized map) is not part of attnopt: out of scope",
    "budget": "budget_bisect (budget-constrained sparsemax) is not part of attnopt: out of scope",
}


def _alpha(alpha: Any) -> Any:
    return float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else alpha


def sparsemax(X: Tensor, dim: int = -1, k: int | None = None, return_support_size: bool = False) -> Tensor:  # noqa: N803
    if return_support_size:
        pytest.skip("return_support_size: not an attnopt feature")
    return attnopt.sparsemax(X, dim=dim)


def entmax15(X: Tensor, dim: int = -1, k: int | None = None, return_support_size: bool = False) -> Tensor:  # noqa: N803
    if return_support_size:
        pytest.skip("return_support_size: not an attnopt feature")
    return attnopt.entmax(X, 1.5, dim=dim)


def sparsemax_bisect(X: Tensor, dim: int = -1, n_iter: int = 50, ensure_sum_one: bool = True) -> Tensor:  # noqa: N803
    return attnopt.sparsemax(X, dim=dim)


def entmax_bisect(
    X: Tensor, alpha: float | Tensor = 1.5, dim: int = -1, n_iter: int = 50, ensure_sum_one: bool = True  # noqa: N803
) -> Tensor:
    return attnopt.entmax(X, _alpha(alpha), dim=dim)


def normmax_bisect(*args: Any, **kwargs: Any) -> Tensor:
    pytest.skip(OUT_OF_SCOPE["normmax"])


def budget_bisect(*args: Any, **kwargs: Any) -> Tensor:
    pytest.skip(OUT_OF_SCOPE["budget"])


class Sparsemax(nn.Module):
    def __init__(self, dim: int = -1, k: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, X: Tensor) -> Tensor:  # noqa: N803
        return attnopt.sparsemax(X, dim=self.dim)


class Entmax15(nn.Module):
    def __init__(self, dim: int = -1, k: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, X: Tensor) -> Tensor:  # noqa: N803
        return attnopt.entmax(X, 1.5, dim=self.dim)


class EntmaxBisect(nn.Module):
    def __init__(self, alpha: float | Tensor = 1.5, dim: int = -1, n_iter: int = 50) -> None:
        super().__init__()
        self.alpha, self.dim = alpha, dim

    def forward(self, X: Tensor) -> Tensor:  # noqa: N803
        return attnopt.entmax(X, _alpha(self.alpha), dim=self.dim)


def _reduction(reduction: str) -> str:
    return "mean" if reduction == "elementwise_mean" else reduction


class SparsemaxLoss(ann.SparsemaxLoss):
    def __init__(self, k: int | None = None, ignore_index: int = -100, reduction: str = "elementwise_mean",
                 return_support_size: bool = False) -> None:
        super().__init__(reduction=_reduction(reduction), ignore_index=int(ignore_index))  # type: ignore[arg-type]


class SparsemaxBisectLoss(ann.SparsemaxLoss):
    def __init__(self, n_iter: int = 50, ignore_index: int = -100,
                 reduction: str = "elementwise_mean") -> None:
        super().__init__(reduction=_reduction(reduction), ignore_index=int(ignore_index))  # type: ignore[arg-type]


class Entmax15Loss(ann.EntmaxLoss):
    def __init__(self, k: int | None = 100, ignore_index: int = -100, reduction: str = "elementwise_mean",
                 return_support_size: bool = False) -> None:
        super().__init__(1.5, reduction=_reduction(reduction), ignore_index=int(ignore_index))  # type: ignore[arg-type]


class EntmaxBisectLoss(ann.EntmaxLoss):
    def __init__(self, alpha: float | Tensor = 1.5, n_iter: int = 50, ignore_index: int = -100,
                 reduction: str = "elementwise_mean") -> None:
        super().__init__(_alpha(alpha), reduction=_reduction(reduction), ignore_index=int(ignore_index))  # type: ignore[arg-type]


class NormmaxBisectLoss(nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, X: Tensor, target: Tensor) -> Tensor:  # noqa: N803
        pytest.skip(OUT_OF_SCOPE["normmax"])

