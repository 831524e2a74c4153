"""Reading values inside ``torch.func`` transforms (internal).

A data-dependent Python decision (``bool(x.all())``, ``float(x.max())``) raises under ``vmap``
("It looks like you're calling .item() on a Tensor"). Where the decision is about the whole
call (a path choice, an input check), it can be read from the values under the wrappers:
reduce inside the transform to one value per example, then read the batch of them. For vmap
that is the same reading as the batched call's; under ``grad`` / ``jvp`` it is the value itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._native import forward_ad_active
from attnopt._validation import _values

__all__ = ["level", "all_true", "largest", "under_transform"]

#: the current ``torch.func`` transform level, ``None`` outside every transform (~40 ns)
level = torch._C._functorch.maybe_current_level


def under_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...) is running,
    or a ``torch.autograd.forward_ad`` dual level is open.

    A transform's tensors are wrappers without storage, and the ctx-style Functions of the fused
    paths have no vmap rule and refuse ``grad``; dual tensors have storage but no Function here
    has a forward-mode rule outside ``torch.func``. Callers take their plain differentiable
    PyTorch-ops path then, so the transforms and forward AD apply by PyTorch's own rules. ~100 ns.
    """
    return level() is not None or forward_ad_active()


def all_true(x: Tensor) -> bool:
    """``bool(x.all())``, also for a tensor wrapped by ``torch.func`` (all its examples)."""
    values = _values(x)
    return True if values is None else bool(values.all())


def largest(x: Tensor) -> float:
    """``float(x.max())``, also for a tensor wrapped by ``torch.func`` (the largest over its examples)."""
    values = _values(x)
    return float("nan") if values is None or not values.numel() else float(values.max())
