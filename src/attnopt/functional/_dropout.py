r"""Attention dropout, as :func:`torch.nn.functional.scaled_dot_product_attention` applies it.

``dropout_p = p`` zeroes each weight ``π_ij`` independently with probability ``p`` and scales the
kept ones by ``1/(1 − p)`` *before* the weighted sum over the values:

.. math:: \mathrm{out}_i = \sum_j \frac{\xi_{ij}}{1 - p}\, \pi_{ij} v_j,
          \qquad \xi_{ij} \sim \mathrm{Bernoulli}(1 - p)

so ``E[out] = π v`` (the output without dropout). As in SDPA the functional ops apply it whenever
``dropout_p > 0`` (the modules pass ``dropout if self.training else 0``).

The streaming and fused paths of the mechanisms never hold the ``Nq × Nk`` weights, so a call with
``dropout_p > 0`` runs the mechanism's materialized weights (its ``*_weights`` function, plain
differentiable PyTorch ops) followed by this dropout and one matmul: O(Nq·Nk) memory, as SDPA's
math kernel with dropout. ``dropout_p = 0`` never reaches this module (the ops are unchanged).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["check_dropout_p", "dropout_attention"]


def check_dropout_p(dropout_p: object) -> float:
    """``dropout_p`` as a float in ``[0, 1)``.

    Raises:
        TypeError: not a real number.
        ValueError: outside ``[0, 1)``.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def dropout_attention(weights: Tensor, v: Tensor, dropout_p: float, dtype: torch.dtype) -> Tensor:
    """``dropout(weights, dropout_p) @ v`` in the weights' dtype, cast to ``dtype``.

    Args:
        weights: (..., Nq, Nk) attention weights (float32 for half-precision inputs).
        v: (..., Nk, dv) values.
        dropout_p: probability in ``(0, 1)`` of zeroing a weight (kept ones are scaled by
            ``1/(1 − p)``).
        dtype: the output dtype (the dtype of ``q``).
    Returns:
        (..., Nq, dv).
    """
    dropped = F.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(dropped, v.to(dropped.dtype)).to(dtype)
