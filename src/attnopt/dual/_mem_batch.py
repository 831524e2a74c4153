"""Input validation and the canonical ``(K, Q, ...)`` layout of MEM problems (internal).

A batch of MEM problems is given as ``templates (..., n, d)``, ``z (..., d)`` and an
optional ``preference (..., n)`` whose leading dimensions broadcast. Leading dimensions in
which ``templates`` has size 1 while the batch does not (e.g. the query axis of
``templates (B, H, 1, n, d)`` against ``z (B, H, Nq, d)``) are the *shared* axes: they are
moved to the back and flattened into ``Q`` so that each template set (``K`` of them) is used
by ``Q`` problems without being copied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnopt._validation import check_tensor

__all__ = ["MEMBatch", "canonicalize", "check_alpha", "check_solver_knobs", "safe_log"]


def check_alpha(alpha: float) -> float:
    """``alpha`` as a float; ``ValueError`` unless finite and > 0."""
    if isinstance(alpha, Tensor) or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(f"alpha must be a Python float, got {type(alpha).__name__}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    return float(alpha)


def check_solver_knobs(tol: float, max_iter: int) -> None:
    """``ValueError`` unless ``tol > 0`` and ``max_iter >= 1`` (an int)."""
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not math.isfinite(tol) or tol <= 0:
        raise ValueError(f"tol must be a finite number > 0, got {tol}")
    if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter}")


def safe_log(u: Tensor) -> Tensor:
    """``log u`` with ``log 0 = -inf`` and a zero (not NaN) gradient at ``u = 0``."""
    positive = u > 0
    return torch.where(positive, torch.where(positive, u, torch.ones_like(u)).log(), float("-inf"))


@dataclass(frozen=True)
class MEMBatch:
    """Canonical layout: ``T (K,n,d)``, ``z (K,Q,d)``, ``logu (K,Q or 1,n)`` + how to undo it."""

    T: Tensor
    z: Tensor
    logu: Tensor
    batch: tuple[int, ...]
    perm: tuple[int, ...]

    def restore(self, x: Tensor) -> Tensor:
        """``(K, Q, *tail)`` -> ``(*batch, *tail)``."""
        tail = x.shape[2:]
        permuted = tuple(self.batch[i] for i in self.perm)
        y = x.reshape(*permuted, *tail)
        inv = [0] * len(self.perm)
        for j, i in enumerate(self.perm):
            inv[i] = j
        nb = len(self.perm)
        return y.permute(*inv, *range(nb, nb + len(tail)))


def _pad(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    return (1,) * (n - len(shape)) + tuple(shape)


def validate(templates: Tensor, z: Tensor, preference: Tensor | None) -> tuple[int, ...]:
    """Check the three inputs; return the broadcast batch shape.

    Raises:
        TypeError: non-tensor / non-floating inputs.
        ValueError: shape mismatch, non-finite values, negative or all-zero preference rows.
    """
    check_tensor("templates", templates, min_dim=2)
    check_tensor("z", z, min_dim=1)
    n, d = templates.shape[-2:]
    if n < 1 or d < 1:
        raise ValueError(f"templates must be (..., n, d) with n, d >= 1, got {tuple(templates.shape)}")
    if z.shape[-1] != d:
        raise ValueError(f"z must be (..., d) with d = {d} (the templates' last dim), got {tuple(z.shape)}")
    if z.dtype != templates.dtype:
        raise TypeError(f"z must have the dtype of templates ({templates.dtype}), got {z.dtype}")
    if not bool(torch.isfinite(templates).all()):
        raise ValueError("templates must be finite")
    if not bool(torch.isfinite(z).all()):
        raise ValueError("z must be finite")
    shapes = [templates.shape[:-2], z.shape[:-1]]
    if preference is not None:
        check_tensor("preference", preference, min_dim=1)
        if preference.shape[-1] != n:
            raise ValueError(
                f"preference must be (..., n) with n = {n} templates, got {tuple(preference.shape)}"
            )
        if not bool(torch.isfinite(preference).all()):
            raise ValueError("preference must be finite (use 0 to exclude a template)")
        if bool((preference < 0).any()):
            raise ValueError("preference must be non-negative (u >= 0; 0 excludes a template)")
        if bool((preference.sum(-1) <= 0).any()):
            raise ValueError("preference must have a positive entry in every row (all-zero row given)")
        shapes.append(preference.shape[:-1])
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError as exc:
        raise ValueError(
            "leading dims of templates (..., n, d), z (..., d) and preference (..., n) do not broadcast: "
            f"{[tuple(s) for s in shapes]}"
        ) from exc


def canonicalize(templates: Tensor, z: Tensor, logu: Tensor | None, batch: tuple[int, ...]) -> MEMBatch:
    """Put validated inputs into the canonical ``(K, Q, ...)`` layout (see module docstring)."""
    n, d = templates.shape[-2:]
    nb = len(batch)
    tb = _pad(tuple(templates.shape[:-2]), nb)
    shared = [i for i in range(nb) if tb[i] == 1 and batch[i] != 1]
    kept = [i for i in range(nb) if i not in shared]
    perm = tuple(kept + shared)
    K = math.prod(batch[i] for i in kept)
    Q = math.prod(batch[i] for i in shared)
    T = templates.reshape(*tb, n, d).permute(*perm, nb, nb + 1).reshape(K, n, d)
    zc = z.expand(*batch, d).permute(*perm, nb).reshape(K, Q, d)
    if logu is None:
        lc = torch.zeros(K, 1, n, dtype=templates.dtype, device=templates.device)
    else:
        lb = _pad(tuple(logu.shape[:-1]), nb)
        if all(lb[i] == 1 for i in shared):
            target = tuple(1 if i in shared else batch[i] for i in range(nb))
            lc = logu.expand(*target, n).permute(*perm, nb).reshape(K, 1, n)
        else:
            lc = logu.expand(*batch, n).permute(*perm, nb).reshape(K, Q, n)
    return MEMBatch(T=T, z=zc, logu=lc.to(templates.dtype), batch=batch, perm=perm)
