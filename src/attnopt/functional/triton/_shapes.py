"""Shapes and masks for the Triton kernels (internal): 4-D views, key bias, stride-0 masks.

The kernels take ``(B, H, N, ·)`` tensors with any strides, so broadcasting costs no copy: a
mask that broadcasts to ``(B, H, Nq, Nk)`` is passed as an expanded view (stride 0 where it
broadcasts), and query padding ``(B, 1, Nq, 1)`` never becomes an ``Nq × Nk`` tensor. A key-only
mask ``(…, 1, Nk)`` is folded into the kernels' column bias instead (one ``(B, H, Nk)`` vector).
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import additive_mask, broadcast_shapes

__all__ = ["Prepared", "prepare"]


def _to4(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``x (…, N, ·)`` expanded to ``batch`` and viewed 4-D ``(B, H, N, ·)`` (a view when possible)."""
    x = x.expand(*batch, *x.shape[-2:])
    if len(batch) == 2:
        return x
    if len(batch) < 2:
        return x.reshape(*((1,) * (2 - len(batch))), *batch, *x.shape[-2:])
    g = 1
    for n in batch[:-1]:
        g *= n
    return x.reshape(g, batch[-1], *x.shape[-2:])


class Prepared:
    """Inputs in the kernels' form.

    Attributes:
        q, k, v: (B, H, N, ·) views in one dtype (``q``'s).
        key_bias: (B, H, Nk) additive key bias in the potential dtype (0 or finite, ``-inf`` = excluded).
        mask: (B, H, Nq, Nk) additive view (stride 0 where it broadcasts) or None.
        batch: the broadcast batch shape, to restore the output's.
        pot: the potential dtype (float64 for float64 input, else float32).
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor | None, key_bias: Tensor, mask: Tensor | None,
                 batch: tuple[int, ...], pot: torch.dtype) -> None:
        self.q, self.k, self.v, self.key_bias, self.mask = q, k, v, key_bias, mask
        self.batch, self.pot = batch, pot

    def restore(self, out: Tensor) -> Tensor:
        """(B, H, Nq, ·) output back to ``(*batch, Nq, ·)``."""
        return out.reshape(*self.batch, *out.shape[-2:])


def prepare(q: Tensor, k: Tensor, v: Tensor | None, attn_mask: Tensor | None) -> Prepared:
    """Put validated inputs of an attention op in the kernels' form (see :class:`Prepared`)."""
    shapes = [q.shape[:-2], k.shape[:-2]] + ([] if v is None else [v.shape[:-2]])
    batch = broadcast_shapes(*shapes)
    nq, nk = q.shape[-2], k.shape[-2]
    pot = torch.float64 if q.dtype == torch.float64 else torch.float32
    q4 = _to4(q, batch)
    k4 = _to4(k.to(q.dtype), batch)
    v4 = None if v is None else _to4(v.to(q.dtype), batch)
    bh = (q4.shape[0], q4.shape[1])
    m = additive_mask(attn_mask, (*batch, nq, nk), pot)
    mask: Tensor | None = None
    if m is None:
        key_bias = torch.zeros(*bh, nk, dtype=pot, device=q.device)
    elif m.shape[-2] == 1:
        key_bias = _to4(m, batch).reshape(*bh, nk).contiguous()
    else:
        key_bias = torch.zeros(*bh, nk, dtype=pot, device=q.device)
        mask = _to4(m.expand(*batch, nq, nk), batch)
    return Prepared(q4, k4, v4, key_bias, mask, tuple(batch), pot)
