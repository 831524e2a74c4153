"""Cost matrices and shared input checks of OT-based attention (internal).

A cost is given as ``"neg_dot"``, ``"sqeuclidean"``, a callable ``cost(bank, templates)``
returning ``(..., m, n)``, or an explicit ``(..., m, n)`` tensor ``M[a, i] = M(a_a, t_i)``
between the bank ``A`` (m rows) and the templates ``T`` (n rows). Everything downstream uses
the *log kernel* ``-M / γ``, so ``+inf`` costs (kernel 0) are allowed.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnopt._validation import check_broadcastable, check_tensor

__all__ = ["CostSpec", "log_kernel", "check_ot_inputs", "normalized_preference", "check_positive"]

CostSpec = str | Callable[[Tensor, Tensor], Tensor] | Tensor
_NAMED = ("neg_dot", "sqeuclidean")


def check_positive(name: str, x: float) -> float:
    """Return ``float(x)``; ``TypeError`` for tensors, ``ValueError`` unless finite and > 0."""
    if isinstance(x, Tensor) or isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a Python number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def check_ot_inputs(
    z: Tensor | None, templates: Tensor, bank: Tensor | None, *, allow_empty: bool = False
) -> tuple[Tensor, tuple[int, ...]]:
    """Validate ``z (..., Nq, d)``, ``templates (..., n, d)``, ``bank (..., m, d)``.

    Returns:
        ``(bank, batch)`` — the bank (``templates`` when ``None``) and the broadcast batch shape.
    Raises:
        TypeError: non-tensor, non-floating or mixed dtypes.
        ValueError: fewer than 2 dims, empty sets (unless ``allow_empty``), mismatched feature
            size, batch dims that do not broadcast, different devices.
    """
    check_tensor("templates", templates, min_dim=2)
    if templates.shape[-2] == 0 and not allow_empty:
        raise ValueError("templates must hold at least one template (n >= 1)")
    named = [("templates", templates)]
    if bank is not None:
        check_tensor("bank", bank, min_dim=2)
        if bank.shape[-2] == 0 and not allow_empty:
            raise ValueError("bank must hold at least one template (m >= 1)")
        named.append(("bank", bank))
    if z is not None:
        check_tensor("z", z, min_dim=2)
        named.append(("z", z))
    d = templates.shape[-1]
    for name, x in named:
        if x.shape[-1] != d:
            raise ValueError(f"{name} must have feature size d = {d} (from templates), got {tuple(x.shape)}")
        if x.dtype != templates.dtype:
            raise TypeError(f"{name} must have the dtype of templates ({templates.dtype}), got {x.dtype}")
        if x.device != templates.device:
            raise ValueError(f"{name} must be on the device of templates ({templates.device})")
    try:
        batch = tuple(torch.broadcast_shapes(*(x.shape[:-2] for _, x in named)))
    except RuntimeError as exc:
        shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in named)
        raise ValueError(f"batch dimensions do not broadcast: {shapes}") from exc
    return (templates if bank is None else bank), batch


def normalized_preference(
    preference: Tensor | None, batch: tuple[int, ...], n: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``u / Σu`` broadcastable to ``(*batch, n)``; uniform when ``None``; all-zero rows stay zero.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: wrong shape, negative, NaN or infinite entries.
    """
    if preference is None:
        return torch.full((n,), 1.0 / n, dtype=dtype, device=device)
    check_tensor("preference", preference, min_dim=1)
    check_broadcastable("preference", preference, (*batch, n))
    if not torch.isfinite(preference).all():
        raise ValueError("preference must be finite (use 0 to exclude a template)")
    if (preference < 0).any():
        raise ValueError("preference must be non-negative")
    u = preference.to(dtype=dtype, device=device)
    total = u.sum(-1, keepdim=True)
    return u / torch.where(total > 0, total, torch.ones_like(total))


def _check_cost_tensor(m_cost: Tensor, batch: tuple[int, ...], m: int, n: int, square: bool) -> None:
    if not m_cost.is_floating_point():
        raise TypeError(f"cost tensor must be floating point, got {m_cost.dtype}")
    check_broadcastable("cost", m_cost, (*batch, m, n))
    if torch.isnan(m_cost).any():
        raise ValueError("cost must not contain NaN")
    if (m_cost < 0).any():
        raise ValueError("cost must be non-negative (M(t, t') >= 0, fenchel-dual-attention Sec. 9)")
    if not torch.isfinite(m_cost).any(-2).all():
        raise ValueError("cost: every template needs a finite cost to some bank member (an all +inf column)")
    if square:
        finite = torch.isfinite(m_cost)
        same_inf = finite == finite.transpose(-2, -1)
        a = torch.where(finite, m_cost, torch.zeros_like(m_cost))
        close = torch.isclose(a, a.transpose(-2, -1), rtol=1e-5, atol=1e-6)
        if not (same_inf & close).all():
            raise ValueError("cost must be symmetric (M(t, t') = M(t', t)) when the bank is the templates")


def log_kernel(
    cost: CostSpec,
    bank: Tensor,
    templates: Tensor,
    gamma: float,
    *,
    square: bool,
    dtype: torch.dtype,
    batch: tuple[int, ...] | None = None,
) -> Tensor:
    """The log kernel ``-M(a, t_i) / γ`` of shape ``(..., m, n)`` in ``dtype``.

    ``"neg_dot"`` is ``M(a, b) = -aᵀb + C`` with the constant ``C`` left out (it cancels in
    every normalization, so it is exempt from the non-negativity check); ``"sqeuclidean"``
    is ``‖a − b‖²``. A callable or a tensor is checked: non-negative, no NaN, every template
    reachable, and symmetric when ``square`` (the bank *is* the templates). ``batch`` is the
    batch shape the cost must broadcast to (default: that of ``bank`` and ``templates``).

    Raises:
        ValueError: an unknown name or a cost that fails the checks above.
        TypeError: a cost of an unsupported type.
    """
    m, n = bank.shape[-2], templates.shape[-2]
    b32, t32 = bank.to(dtype), templates.to(dtype)
    if isinstance(cost, str):
        if cost == "neg_dot":
            return torch.matmul(b32, t32.transpose(-2, -1)) / gamma
        if cost == "sqeuclidean":
            sq = (b32 * b32).sum(-1, keepdim=True) + (t32 * t32).sum(-1).unsqueeze(-2)
            m_cost = (sq - 2.0 * torch.matmul(b32, t32.transpose(-2, -1))).clamp_min(0.0)
            return -m_cost / gamma
        raise ValueError(f"cost must be one of {_NAMED}, a callable or a tensor, got {cost!r}")
    if batch is None:
        batch = tuple(torch.broadcast_shapes(bank.shape[:-2], templates.shape[:-2]))
    if isinstance(cost, Tensor):
        m_cost = cost
    elif callable(cost):
        m_cost = cost(bank, templates)
        if not isinstance(m_cost, Tensor):
            raise TypeError(f"a cost callable must return a tensor, got {type(m_cost).__name__}")
    else:
        raise TypeError(f"cost must be a str, a callable or a tensor, got {type(cost).__name__}")
    if m_cost.dim() < 2 or tuple(m_cost.shape[-2:]) != (m, n):
        raise ValueError(f"cost must have shape (..., m, n) = (..., {m}, {n}), got {tuple(m_cost.shape)}")
    _check_cost_tensor(m_cost, batch, m, n, square)
    return -m_cost.to(device=bank.device, dtype=dtype) / gamma
