"""Input checks shared by every mechanism (internal).

Every public function validates its arguments here so that bad input raises a
``ValueError``/``TypeError`` naming the argument and what was expected, instead of a
shape error deep inside a kernel or a silent NaN.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_tensor",
    "check_attention_inputs",
    "resolve_scale",
    "check_broadcastable",
    "additive_mask",
    "causal_additive_mask",
    "combine_additive",
    "empty_attention",
    "empty_weights",
]


def check_tensor(name: str, x: object, *, min_dim: int = 1, floating: bool = True) -> Tensor:
    """Raise ``TypeError``/``ValueError`` unless ``x`` is a tensor of at least ``min_dim`` dims."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor | None = None) -> tuple[int, int, int]:
    """Validate ``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)``.

    Returns:
        ``(Nq, Nk, d)``.
    Raises:
        TypeError: a non-tensor or non-floating input, or mixed dtypes.
        ValueError: mismatched head size, key/value length, or batch dimensions.
    """
    check_tensor("q", q, min_dim=2)
    check_tensor("k", k, min_dim=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last (head) dimension, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on the same device, got {q.device} and {k.device}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError as exc:
        raise ValueError(
            f"batch dimensions of q {tuple(q.shape)} and k {tuple(k.shape)} do not broadcast"
        ) from exc
    if v is not None:
        check_tensor("v", v, min_dim=2)
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"v must have as many rows as k (Nk = {k.shape[-2]}), got v {tuple(v.shape)}"
            )
        if v.dtype != q.dtype:
            raise TypeError(f"v must have the dtype of q ({q.dtype}), got {v.dtype}")
        if v.device != q.device:
            raise ValueError(f"v must be on the device of q ({q.device}), got {v.device}")
        try:
            torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        except RuntimeError as exc:
            raise ValueError(
                f"batch dimensions of q, k, v do not broadcast: {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            ) from exc
    return q.shape[-2], k.shape[-2], q.shape[-1]


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """Return ``scale`` or the default ``1/sqrt(head_dim)``; reject non-positive or non-finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, Tensor):
        raise TypeError("scale must be a Python number, not a tensor")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    return scale


def check_broadcastable(name: str, x: Tensor, target: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts to ``target`` without growing ``target``."""
    try:
        out = torch.broadcast_shapes(tuple(x.shape), tuple(target))
    except RuntimeError as exc:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to {tuple(target)}"
        ) from exc
    if tuple(out) != tuple(target):
        raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to {tuple(target)}")


def additive_mask(
    attn_mask: Tensor | None, target: Sequence[int], dtype: torch.dtype, name: str = "attn_mask"
) -> Tensor | None:
    """Convert an SDPA-style mask to an additive float mask (0 = keep, -inf = drop).

    A boolean mask uses PyTorch's SDPA convention: ``True`` means *take part in attention*.
    A floating mask is added to the scores as is. ``target`` is the broadcast shape of the
    scores ``(..., Nq, Nk)``; the mask is not expanded.
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    check_broadcastable(name, attn_mask, target)
    if attn_mask.dtype == torch.bool:
        out = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
        return out.masked_fill_(~attn_mask, float("-inf"))
    if not attn_mask.is_floating_point():
        raise TypeError(f"{name} must be boolean or floating point, got {attn_mask.dtype}")
    # one reduction: max() is NaN if any entry is NaN and +inf if any is +inf
    if attn_mask.numel() and not bool(attn_mask.detach().max() < float("inf")):
        raise ValueError(f"{name} must not contain NaN or +inf")
    return attn_mask.to(dtype)


def causal_additive_mask(nq: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(Nq, Nk)`` additive mask of SDPA's ``is_causal`` (top-left aligned lower triangle)."""
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device).tril()
    return torch.zeros(nq, nk, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))


def combine_additive(*masks: Tensor | None) -> Tensor | None:
    """Sum additive masks, skipping ``None``; ``None`` when all are ``None``."""
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out + m
    return out


def _anchor(*xs: Tensor) -> Tensor:
    """An exact ``0.0`` that depends on every ``x`` (zero gradients, never NaN: empty slices)."""
    total = xs[0].new_zeros(())
    for x in xs:
        total = total + x.narrow(-1, 0, 0).sum().to(total.dtype)
    return total


def empty_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The result every attention op gives for empty sizes, or ``None`` if nothing is empty.

    Policy (one for every op): ``Nq = 0`` or an empty batch/head dimension gives an empty
    output ``(…, Nq, dv)``; ``Nk = 0`` (no key to attend to) gives zeros, like a fully
    masked row. The result is differentiable with zero (finite) gradients for ``q``, ``k``,
    ``v``, and no kernel ever sees an empty tensor.
    """
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape = (*batch, q.shape[-2], v.shape[-1])
    if q.shape[-2] and k.shape[-2] and 0 not in batch:
        return None
    return q.new_zeros(shape) + _anchor(q, k, v).to(q.dtype)


def empty_weights(q: Tensor, k: Tensor) -> Tensor | None:
    """The ``(…, Nq, Nk)`` weights for empty sizes (an empty tensor), or ``None``.

    See :func:`empty_attention`.
    """
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    shape = (*batch, q.shape[-2], k.shape[-2])
    if 0 not in shape:
        return None
    return q.new_zeros(shape) + _anchor(q, k).to(q.dtype)
