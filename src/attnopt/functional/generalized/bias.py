r"""The additive score bias of generalized attention: ``log u + mask (+ causal)`` (internal).

fenchel-dual-attention eq. (16)–(18): a preference distribution ``u`` over the keys enters the
scores as ``log u``; with SDPA-style masks and ``is_causal`` the bias is
``b = log u + m (+ the causal −inf)``, broadcastable to ``(…, Nq, Nk)``. Shared by the router, the
reference, the Triton kernels and the MEM attention (``attnopt.dual``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt import _func
from attnopt._validation import (
    additive_mask,
    broadcast_shapes,
    causal_additive_mask,
    check_attention_inputs,
    check_broadcastable,
    combine_additive,
    device_assert,
    host_values,
    to_rank,
)

__all__ = ["check_log_preference_values", "preference_to_log", "score_bias"]


def _safe_log(u: Tensor) -> Tensor:
    """``log u`` with ``log 0 = -inf`` and a zero (not NaN) gradient at ``u = 0``."""
    positive = u > 0
    return torch.where(positive, torch.where(positive, u, torch.ones_like(u)).log(), float("-inf"))


def preference_to_log(
    preference: Tensor | None,
    log_preference: Tensor | None,
    target: tuple[int, ...],
    dtype: torch.dtype,
    check_values: bool = True,
) -> Tensor | None:
    """Validate ``preference``/``log_preference`` and return ``log u`` broadcastable to ``target``.

    ``check_values=False`` skips the pass over ``log_preference``'s values (NaN / ``+inf``): for
    callers that check them later (:func:`check_log_preference_values`, or the fused node's
    post-hoc check).

    Raises:
        ValueError: both given; negative, NaN or infinite ``preference``; NaN or ``+inf`` in
            ``log_preference``; a shape that does not broadcast to ``target``.
        TypeError: not a floating-point tensor.
    """
    if preference is not None and log_preference is not None:
        raise ValueError("pass either preference or log_preference, not both")
    if preference is not None:
        if not isinstance(preference, Tensor) or not preference.is_floating_point():
            raise TypeError("preference must be a floating-point torch.Tensor")
        check_broadcastable("preference", preference, target)
        values = host_values(preference) if preference.numel() else None  # VALUE_CHECKS policy
        if values is not None:
            low, high = torch.aminmax(values.detach())  # one pass; NaN propagates
            if not bool(torch.isfinite(high)) or not bool(torch.isfinite(low)):
                raise ValueError("preference must be finite (use 0 to mask a key)")
            if bool(low < 0):
                raise ValueError("preference must be non-negative (u >= 0; 0 masks a key)")
        elif preference.numel():
            device_assert(preference, lambda t: (t.amin() >= 0) & torch.isfinite(t.amax()),
                          "preference must be finite and non-negative")
        log_u = _safe_log(preference) if preference.requires_grad else preference.log()
        return to_rank(log_u.to(dtype), len(target))
    if log_preference is not None:
        if not isinstance(log_preference, Tensor) or not log_preference.is_floating_point():
            raise TypeError("log_preference must be a floating-point torch.Tensor")
        check_broadcastable("log_preference", log_preference, target)
        if check_values:
            check_log_preference_values(log_preference)
        return to_rank(log_preference.to(dtype), len(target))
    return None


_LOG_PREFERENCE_ERROR = "log_preference must not contain NaN or +inf (-inf masks a key)"


def check_log_preference_values(log_preference: Tensor) -> tuple[float, float]:
    """``(min, max)`` of ``log_preference`` after checking it has no NaN or ``+inf``.

    One ``aminmax`` pass, remembered on the tensor with its version counter: a cached bias
    (ALiBi's, built once per length) is read once, not on every call; an in-place change
    bumps the version and is read again. Where value checks do not read on the host
    (:func:`attnopt._validation.host_values`: off the CPU, compiling, meta) nothing is read and
    ``(0.0, 0.0)`` is returned (the streaming path then calls SDPA directly).

    Raises:
        ValueError: NaN or ``+inf`` in ``log_preference``.
    """
    if not log_preference.numel():
        return 0.0, 0.0
    stamp = getattr(log_preference, "_attnopt_range", None)
    if stamp is not None and stamp[0] == log_preference._version:
        lo, hi = stamp[1], stamp[2]
    else:
        under = host_values(log_preference)  # under torch.func: the values under the wrappers
        if under is None:  # off the CPU, compiling, meta / fake: nothing read on the host
            device_assert(log_preference, lambda t: t.amax() < float("inf"), _LOG_PREFERENCE_ERROR)
            return 0.0, 0.0
        values = log_preference if _func.level() is None else under
        low, high = torch.aminmax(values.detach())  # NaN propagates into both
        lo, hi = float(low), float(high)
        if values is log_preference and not torch.compiler.is_compiling():
            log_preference._attnopt_range = (log_preference._version, lo, hi)  # type: ignore[attr-defined]
    if not hi < float("inf"):
        raise ValueError(_LOG_PREFERENCE_ERROR)
    return lo, hi


def score_bias(
    q: Tensor,
    k: Tensor,
    preference: Tensor | None,
    log_preference: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    dtype: torch.dtype | None = None,
    check_values: bool = True,
) -> Tensor | None:
    """Validated ``log u + mask (+ causal)`` broadcastable to ``(..., Nq, Nk)``, or ``None``.

    Shared by every mechanism that takes a preference next to SDPA-style masks. ``dtype``
    defaults to ``q.dtype``; ``check_values`` as in :func:`preference_to_log`.
    """
    nq, nk, _ = check_attention_inputs(q, k)
    dtype = q.dtype if dtype is None else dtype
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    target = (*batch, nq, nk)
    log_u = preference_to_log(preference, log_preference, target, dtype, check_values)
    mask = additive_mask(attn_mask, target, dtype)
    causal = causal_additive_mask(nq, nk, dtype, q.device) if is_causal else None
    return combine_additive(log_u, mask, causal)
