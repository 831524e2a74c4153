r"""Sparsemax / α-entmax attention in plain PyTorch: the readable oracle (any device).

sdpa-one-sided-eot Prop. 4.2–4.3: scores ``s = scale·QKᵀ + M − β|i − j|`` (``M`` additive,
``-inf`` = dropped; ``β`` the optional locality; ``is_causal`` drops ``j > i``), then the map
(``weights``, handed in by the router: :func:`attnopt.functional.regularized.entmax`) along the
keys and the weighted values:

.. math:: \mathrm{out} = \mathrm{entmax}_\alpha(s)\, V, \qquad
          \mathrm{entmax}_\alpha(s) = \arg\max_{p \in \Delta} \langle s, p\rangle + H^T_\alpha(p)

Every op is tracked, so autograd gives first and higher derivatives: the fused kernels of
:mod:`.materialized` and :mod:`.streaming` run it for an exact double backward
(``create_graph=True``). Half precision is computed in float32.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["sparse_attention"]


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, beta: Tensor | None, alpha: float,
                     scale: float, causal: bool, *, weights: Callable[[Tensor, float], Tensor]) -> Tensor:
    """``entmax_α(s) V`` in tracked plain ops (``(*batch, N, ·)`` inputs; ``beta`` 0-d or per head);
    ``weights(s, alpha)``: the map along the last dim."""
    c = _compute(q.dtype)
    s = torch.matmul(q.to(c), k.to(c).transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask
    if beta is not None:
        pos = torch.arange(q.shape[-2], device=s.device)
        dist = (pos[:, None] - torch.arange(k.shape[-2], device=s.device)[None, :]).abs().to(beta.dtype)
        s = s - (beta * dist if beta.dim() == 0 else beta.view(-1, 1, 1) * dist).to(c)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = weights(s, alpha)
    return torch.matmul(p, v.to(c)).to(q.dtype)
