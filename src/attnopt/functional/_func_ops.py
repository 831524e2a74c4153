r"""The ``torch.library`` ops under ``torch.func`` transforms (internal; issue 30 item 2).

PyTorch 2.13 connects a ``custom_op`` to autograd (``register_autograd``) through a ctx-style
``autograd.Function``, which ``torch.func.grad`` / ``vjp`` / ``jacrev`` refuse ("it must
override the setup_context staticmethod"). :func:`transform_function` wraps an op and the
``setup_context`` / backward it registered in a setup-context-style Function that the transforms
accept: ``grad`` runs its forward (the op) on the unwrapped tensors and its backward (the backward
op) on the gradients; ``generate_vmap_rule`` runs both under ``vmap``, where the ops' own batching
rules (``torch.library.register_vmap``, e.g. :func:`merge_batch` / :func:`split_batch` folding
the vmapped dimension into the op's batch dimension) make one call of each.

The backward is first order: :func:`attnopt.functional._autograd.refuse_double_backward` raises
under ``create_graph=True``, and :func:`attnopt.functional._autograd.first_order_only` marks its
gradients when ordinary autograd around a transform tracks them. Under ``torch.func`` a second
derivative (``grad(grad(f))``, ``hessian``) would not reach that check — the outer level sees the
inner gradients as constants — so :func:`transforms_supported` admits only ``vmap`` levels and at
most one ``grad`` level (``grad``, ``vjp``, ``jacrev``; no ``jvp`` / ``jacfwd`` / ``functionalize``,
no forward-AD dual level), and no ordinary autograd around them. Elsewhere the routers keep their
plain-PyTorch reference, which every transform differentiates by PyTorch's own rules.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._C._functorch as _ft
from torch import Tensor

from attnopt._native import forward_ad_active
from attnopt.functional._autograd import base_requires_grad, first_order_only, refuse_double_backward

__all__ = ["merge_batch", "split_batch", "transform_function", "transforms_supported"]


def transforms_supported(*inputs: Tensor | None) -> bool:
    """Whether the running ``torch.func`` transforms are ``vmap`` levels and at most one ``grad``
    level (``grad`` / ``vjp`` / ``jacrev``), with no forward-AD dual level open and no ordinary
    autograd tracking ``inputs`` around the transforms (a plain tensor under the wrappers that
    requires grad: ``torch.autograd.grad`` of ``torch.func.grad(f)(x)``, a module's parameters
    inside ``jacrev``): where a :func:`transform_function` gives the transforms' exact answer
    (~1 µs). Where it does not, a second derivative through the first-order backward could be
    asked for."""
    if forward_ad_active():
        return False
    if any(x is not None and base_requires_grad(x) for x in inputs):
        return False
    grads = 0
    for interpreter in _ft.get_interpreter_stack() or ():
        key = interpreter.key()
        if key == _ft.TransformType.Grad:
            grads += 1
        elif key != _ft.TransformType.Vmap:
            return False
    return grads <= 1


def transform_function(
    op: Callable[..., Any], setup_context: Callable[..., None], backward: Callable[..., tuple],
    name: str, instead: str,
) -> type[torch.autograd.Function]:
    """A setup-context-style ``autograd.Function`` computing ``op`` with the ``setup_context`` and
    ``backward`` that were registered for it (``op.register_autograd``), for ``torch.func``.

    Args:
        op: the forward op (``torch.ops.attnopt.X``).
        setup_context, backward: the functions given to ``register_autograd``; ``backward`` runs
            with autograd off (its ops are not differentiated again; see the module docstring).
        name: the public op, for the first-order-only errors.
        instead: what to call for second derivatives.
    """

    def forward(*args: Any) -> Any:
        return op(*args)

    def run_backward(ctx: Any, *grads: Any) -> Any:
        refuse_double_backward(ctx, name, instead)
        with torch.no_grad():  # the backward op's own autograd wrapper is ctx-style: not under a transform
            out = backward(ctx, *grads)
        return first_order_only(ctx, out, name)

    return type(
        "TransformFunction", (torch.autograd.Function,),
        {"generate_vmap_rule": True, "forward": staticmethod(forward),
         "setup_context": staticmethod(setup_context), "backward": staticmethod(run_backward)},
    )


def merge_batch(x: Tensor | None, dim: int | None, size: int, lead: int) -> Tensor | None:
    """``x`` of a ``vmap`` batching rule as one batch: the vmapped dimension ``dim`` (``None``: not
    vmapped, the same for every example) of ``size`` examples folded into the leading dimension,
    broadcast to ``lead`` first (an example's ``(1 or lead, …)`` becomes ``(size·lead, …)``)."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.expand(size, lead, *x.shape[2:]).reshape(size * lead, *x.shape[2:])


def split_batch(x: Tensor, size: int) -> tuple[Tensor, int | None]:
    """An output of an op called on :func:`merge_batch`'s inputs, split back per example:
    ``(size·n, …) → (size, n, …)`` with out-dim 0; an empty placeholder or a 0-d flag (one value
    for the whole call) is shared, out-dim ``None``."""
    if x.dim() == 0 or x.numel() == 0:
        return x, None
    return x.reshape(size, x.shape[0] // size, *x.shape[1:]), 0
