"""Float64 loop oracle of the autoregressive (``causal="prefix"``) DNAS / Sinkhorn-K / HNAS (tests only).

Literally the definition: for every query ``i``, take the first ``i + 1`` rows of the scores,
run the paper's K (column, row) normalizations on that block alone
(:func:`tests.reference.doubly_normalized.sinkhorn_weights_ref`) and keep its last row. Row
``i`` is computed from rows ``0..i`` only, so changing anything after ``i`` cannot change it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tests.reference.doubly_normalized import scores_ref, sinkhorn_weights_ref


def prefix_weights_ref(s: Tensor, iterations: int) -> Tensor:
    """(…, Nq, Nk) weights: row i = last row of Sinkhorn-K on ``s[..., :i+1, :]``."""
    rows = [sinkhorn_weights_ref(s[..., : i + 1, :], iterations)[..., i, :] for i in range(s.shape[-2])]
    return torch.stack(rows, dim=-2)


def prefix_attention_ref(q: Tensor, k: Tensor, v: Tensor, iterations: int = 1, *, scale: float | None = None,
                         mask: Tensor | None = None, is_causal: bool = True) -> Tensor:
    return prefix_weights_ref(scores_ref(q, k, scale, mask, is_causal), iterations) @ v


def prefix_hybrid_ref(q: Tensor, k: Tensor, v: Tensor, weight: Tensor, iterations: int = 1, *,
                      scale: float | None = None, mask: Tensor | None = None,
                      is_causal: bool = True) -> Tensor:
    s = scores_ref(q, k, scale, mask, is_causal)
    w = weight.reshape(-1, 1, 1) if weight.dim() == 1 else weight
    pi = w * prefix_weights_ref(s, iterations) + (1 - w) * sinkhorn_weights_ref(s, 0)
    return pi @ v
