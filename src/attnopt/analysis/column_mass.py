r"""Column mass of attention weights: the explaining-away statistic (doubly-normalized-attention Fig. 1).

.. math:: m_j = \sum_i \pi_{ij}

The total attention a key receives from all queries. For row-stochastic weights the column
masses sum to ``Nq``; Lemma 1 of the paper states that DNAS keeps every ``m_j >= 1/N_k``
(for ``Nq = N_k``), while for softmax attention (LNAS) a key can be "explained away"
(``m_j -> 0``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import check_tensor

__all__ = ["column_mass"]


def column_mass(weights: Tensor) -> Tensor:
    r"""Total attention each key receives, :math:`m_j = \sum_i \pi_{ij}`.

    Args:
        weights: (..., Nq, Nk) attention weights (e.g. ``(B, H, Nq, Nk)``).
    Returns:
        (..., Nk) column sums, in the dtype of ``weights`` (half precision summed in float32).
    Raises:
        TypeError: not a floating-point tensor.
        ValueError: fewer than 2 dimensions.
    """
    check_tensor("weights", weights, min_dim=2)
    if weights.dtype in (torch.float16, torch.bfloat16):
        return weights.float().sum(dim=-2).to(weights.dtype)
    return weights.sum(dim=-2)
