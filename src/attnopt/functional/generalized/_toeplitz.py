"""A bias that depends on the offset ``j − i`` only, with its per-offset values attached (internal).

A relative-position bias (T5's buckets, ALiBi) is a Toeplitz matrix per head,
``bias[0, h, i, j] = offsets[h, j − i + Nq − 1]``. Its builder lays it out as the usual
``(1, H, Nq, Nk)`` tensor and records ``offsets (H, Nq + Nk − 1)`` on it with
:func:`mark_toeplitz`; a consumer that can use the structure (the C path of
:mod:`.cpu`: the bias row ``i`` is the window of ``offsets`` that starts at
``Nq − 1 − i``, and its gradient collects into ``Nq + Nk − 1`` sums per head) takes
:func:`toeplitz_offsets` instead of the bias — and the gradient then reaches the parameters
through ``offsets``. Any other use of the tensor (or a copy, a sum with a mask, a reshape,
an in-place change: its version counter is checked) sees an ordinary tensor.

T5's bias is marked one step further back, with its bucket table ``(num_buckets, H)`` and the
bucket of each offset (:func:`mark_toeplitz_table`): the whole-call C path of
:mod:`.cpu` takes the table itself (one autograd input, its gradient scattered
into the buckets in C); :func:`toeplitz_offsets` gathers the offsets from it when asked.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_toeplitz", "mark_toeplitz", "mark_toeplitz_table", "toeplitz_offsets", "toeplitz_table"]

_ATTR = "_attnopt_toeplitz_offsets"
_TABLE = "_attnopt_toeplitz_table"


def mark_toeplitz(bias: Tensor, offsets: Tensor) -> Tensor:
    """Record on ``bias (1, H, Nq, Nk)`` that it equals ``offsets (H, Nq + Nk − 1)`` laid out by offset."""
    _, h, nq, nk = bias.shape
    if offsets.shape != (h, nq + nk - 1):
        raise ValueError(f"offsets must be ({h}, {nq + nk - 1}), got {tuple(offsets.shape)}")
    setattr(bias, _ATTR, (offsets, bias._version))
    return bias


def mark_toeplitz_table(bias: Tensor, table: Tensor, buckets: Tensor) -> Tensor:
    """Record on ``bias (1, H, Nq, Nk)`` that ``bias[0, h, i, j] = table[buckets[j − i + Nq − 1], h]``
    (``table (num_buckets, H)``, ``buckets (Nq + Nk − 1,)`` int64)."""
    _, h, nq, nk = bias.shape
    if table.dim() != 2 or table.shape[1] != h or buckets.shape != (nq + nk - 1,):
        raise ValueError(f"table must be (num_buckets, {h}) and buckets ({nq + nk - 1},), got "
                         f"{tuple(table.shape)} and {tuple(buckets.shape)}")
    setattr(bias, _TABLE, (table, buckets, bias._version, table._version))
    return bias


def toeplitz_table(bias: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(table, buckets)`` recorded by :func:`mark_toeplitz_table`, or ``None`` (none, or ``bias``
    or the table changed in place since)."""
    hit = getattr(bias, _TABLE, None)
    if hit is None or hit[2] != bias._version or hit[3] != hit[0]._version:
        return None
    return hit[0], hit[1]


def toeplitz_offsets(bias: Tensor) -> Tensor | None:
    """The ``offsets`` recorded on ``bias`` by :func:`mark_toeplitz` (or gathered from the table of
    :func:`mark_toeplitz_table`, with its gradient), or ``None`` (none, or changed since)."""
    if bias.dim() != 4 or bias.shape[0] != 1:
        return None
    hit = getattr(bias, _ATTR, None)
    if hit is None or hit[1] != bias._version:
        table = toeplitz_table(bias)
        if table is None:
            return None
        weight, buckets = table
        if not bias.requires_grad:
            weight = weight.detach()  # a bias built without a graph gives the table no gradient
        return weight.t().index_select(1, buckets)
    offsets: Tensor = hit[0]
    return offsets


def causal_toeplitz(log_u: Tensor, combined: Tensor) -> Tensor:
    """``combined = log_u + causal mask``, marked when ``log_u`` is: SDPA's top-left causal mask
    (key ``j`` hidden from query ``i`` when ``j > i``) depends on ``j − i`` only as well."""
    offsets = toeplitz_offsets(log_u)
    if (offsets is None or combined.dim() != 4 or combined.shape[0] != 1
            or combined.shape[1] != offsets.shape[0]):
        return combined
    nq = combined.shape[-2]
    hidden = torch.arange(offsets.shape[-1], device=offsets.device) > nq - 1  # offset j − i > 0
    mask = torch.zeros(hidden.shape, dtype=offsets.dtype, device=offsets.device)
    mask.masked_fill_(hidden, float("-inf"))
    return mark_toeplitz(combined, offsets + mask)
