r"""Generalized attention in plain PyTorch: the readable oracle and the fallback (any device).

fenchel-dual-attention eq. (16)–(18): with the additive bias ``b = log u + m (+ causal)`` of
:mod:`.bias`,

.. math:: \pi = \mathrm{softmax}_j(\alpha\,QK^\top + b), \qquad \mathrm{out} = \pi V

(a row with no admissible key gets zeros, not NaN). The router runs it under
``attnopt.backend("reference")`` and inside ``torch.func`` transforms; ``generalized_weights``
is this softmax. Autograd runs through the ops. Half precision is computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.functional._softmax import safe_softmax

__all__ = ["attention", "weights"]


def weights(q: Tensor, k: Tensor, bias: Tensor | None, alpha: float, dropout_p: float = 0.0) -> Tensor:
    """``(…, Nq, Nk)`` weights ``softmax(α QKᵀ + bias)`` (float32 for half inputs; dropout applied)."""
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * alpha
    if bias is not None:
        scores = scores + bias.to(compute)
    p = safe_softmax(scores, dim=-1)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p)
    return p


def attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alpha: float, dropout_p: float = 0.0,
) -> Tensor:
    """``softmax(α QKᵀ + bias) V`` in ``q.dtype``."""
    p = weights(q, k, bias, alpha, dropout_p)
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype)
