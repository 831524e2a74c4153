r"""DNAS / Sinkhorn-K / HNAS in plain PyTorch: the readable oracle and the fallback (any device).

doubly-normalized-attention eq. (6)–(8), (10) and Sec. 6. Scores ``s = scale·QKᵀ + M`` (``M``
additive, ``-inf`` = dropped; ``is_causal`` adds SDPA's top-left causal ``-inf``); K times, in
the log domain, a column normalization (over the queries) then a row normalization (over the
keys):

.. math:: s \leftarrow s - \mathrm{LSE}_i\, s, \qquad s \leftarrow s - \mathrm{LSE}_j\, s,
          \qquad \pi = e^{s}

K = 0 is the row softmax (LNAS). HNAS mixes ``π = w π^{(K)} + (1 − w) π^{(0)}``. A slice with no
admissible entry keeps weight 0 (its log-sum-exp is ``-inf`` and is not subtracted), so a row
with no admissible key gives zeros and a key no query sees gets weight 0.

The router (``doubly_normalized/__init__.py``) runs this under ``attnopt.backend("reference")``,
``torch.func`` transforms, on meta tensors, off the CPU below the crossover (one graph of
plain ops: no host read, no loop over batch × heads, exact for a dominated row), for a mask that
requires grad, and when a fast kernel reports an underflowing normalizer. Autograd runs
through the ops (first and higher derivatives). Half precision is computed in float32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import additive_mask, causal_additive_mask, check_attention_inputs
from attnopt.functional._softmax import safe_logsumexp, safe_softmax

__all__ = ["sinkhorn_weights", "attention"]

_HALF = (torch.float16, torch.bfloat16)


def sinkhorn_weights(
    q: Tensor, k: Tensor, iterations: int, attn_mask: Tensor | None, scale: float, is_causal: bool,
) -> Tensor:
    """``(…, Nq, Nk)`` weights after K (column, row) log-domain normalizations (K = 0: softmax).

    Inputs validated by the caller; the result is float32 for half inputs, else ``q.dtype``.
    """
    nq, nk, _ = check_attention_inputs(q, k)
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    s = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale
    m = additive_mask(attn_mask, (*batch, nq, nk), compute)
    if m is not None:
        s = s + m
    if is_causal:
        s = s + causal_additive_mask(nq, nk, compute, q.device)
    if iterations == 0:
        return safe_softmax(s, dim=-1)
    for _ in range(iterations):
        for dim in (-2, -1):
            lse = safe_logsumexp(s, dim=dim, keepdim=True)  # -inf for an empty slice
            s = s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s)


def attention(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None, attn_mask: Tensor | None,
    scale: float, is_causal: bool,
) -> Tensor:
    """``π V`` with ``π`` of :func:`sinkhorn_weights` (HNAS: mixed with the softmax by ``weight``,
    shaped to broadcast against ``(…, H, Nq, Nk)``); ``(…, Nq, dv)`` in ``q.dtype``."""
    p = sinkhorn_weights(q, k, iterations, attn_mask, scale, is_causal)
    if weight is not None:
        p = torch.lerp(sinkhorn_weights(q, k, 0, attn_mask, scale, is_causal), p, weight.to(p.dtype))
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype)
