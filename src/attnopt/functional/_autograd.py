r"""Double-backward policy of the library's custom ``torch.autograd.Function``\ s (internal).

A closed-form backward that reads saved forward intermediates, writes into preallocated
buffers or detaches a parameter computes the right *first* derivative, but its result is
not a differentiable function of the inputs: under ``create_graph=True`` (a gradient
penalty, ``gradgradcheck``, Hessian-vector products) the second derivative would be
silently wrong. ``@once_differentiable`` does not prevent that: it attaches its error node
to detached copies of the gradients, so ``torch.autograd.grad(..., inputs=...)`` skips the
node and returns a wrong number, and when the incoming gradient does not require grad
there is no error node at all.

Policy: every Function's ``backward`` starts with one of

* :func:`refuse_double_backward` — raises a ``RuntimeError`` naming the op and the plain
  path to use instead, when the backward runs with grad mode on (``create_graph=True``);
* :func:`double_backward` — ``True`` in that case, so the backward can switch to a
  differentiable formula (tracked, out-of-place plain ops; exact second derivatives), e.g.
  :func:`tracked_vjp` of the op's plain-PyTorch form.

``tests/functional/test_double_backward.py`` checks that every Function in ``src`` does one
of the two, and that every public op and registry attention either passes ``gradgradcheck``
in float64 or raises.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._C._functorch as _ft
from torch import Tensor

from attnopt._func import under_transform

__all__ = ["base_requires_grad", "double_backward", "first_order_only", "records_graph", "reduce_to",
           "refuse_double_backward", "tracked_vjp", "under_transform"]


def reduce_to(g: Tensor, shape: torch.Size) -> Tensor:
    """Sum a broadcast gradient ``g`` back to ``shape`` (leading dims dropped, size-1 dims kept)."""
    while g.dim() > len(shape):
        g = g.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


def records_graph(*xs: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ``xs`` (grad mode on and an input that requires grad);
    the no-grad (inference) paths run when it does not."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def double_backward(ctx: Any) -> bool:
    """Whether this backward's result is differentiated again: it runs under
    ``create_graph=True`` with an input that needs grad, or under ``torch.func`` where the result
    is differentiated again.

    ``torch.func`` runs every backward with grad mode on; there the result is differentiated
    again under a second differentiating transform (``grad``/``vjp``/``jacrev``/``jvp``, e.g.
    ``grad(grad(f))``, ``jacfwd(jacrev(f))``), or by ordinary autograd outside the transform
    (``torch.autograd.grad`` of ``torch.func.grad(f)(x)`` with ``x.requires_grad``; seen as a saved
    tensor whose plain tensor, under the transforms' wrappers, requires grad — the parameters of
    a module called inside ``jacrev`` are such tensors too). A single ``torch.func.grad`` /
    ``vjp`` / ``jacrev`` on plain tensors keeps the fast first-order backward — also inside
    ``vmap`` (``vmap(grad(f))``, per-example gradients). A closed form that has a tracked variant
    takes it when this is true (exact, only slower).
    """
    nested, outer = _again(ctx)
    return nested or outer


def _again(ctx: Any) -> tuple[bool, bool]:
    """``(create_graph or a second differentiating transform, ordinary autograd around one)``."""
    if not (torch.is_grad_enabled() and any(ctx.needs_input_grad)):
        return False, False
    saved = ctx.saved_tensors if hasattr(ctx, "saved_tensors") else ()
    if _ft.maybe_current_level() is None:
        # torch.func.vjp calls the backward outside its level; its saved tensors stay wrapped
        return not any(t is not None and _ft.is_functorch_wrapped_tensor(t) for t in saved), False
    if sum(i.key() in _DIFFERENTIATING for i in _ft.get_interpreter_stack()) > 1:
        return True, False
    return False, any(t is not None and base_requires_grad(t) for t in saved)


def base_requires_grad(t: Tensor) -> bool:
    """Whether the plain tensor under ``t``'s ``torch.func`` wrappers requires grad."""
    while _ft.is_functorch_wrapped_tensor(t):
        t = _ft.get_unwrapped(t)
    return t.requires_grad


_DIFFERENTIATING = (_ft.TransformType.Grad, _ft.TransformType.Jvp)


def refuse_double_backward(ctx: Any, op: str, instead: str) -> None:
    """Raise under ``create_graph=True`` or a second differentiating ``torch.func`` transform:
    ``op``'s closed-form backward is first order only.

    Ordinary autograd around a single transform (:func:`double_backward`'s second case) is not
    refused here: there the graph exists whenever a module's parameters require grad (``jacrev``
    of a module's output) and is rarely differentiated; the backward returns its gradients
    through :func:`first_order_only`, which raises only when they are differentiated.

    Args:
        ctx: the Function's context.
        op: the public op (and path) the Function implements, e.g. ``"sparse attention (fused)"``.
        instead: what to call for second derivatives (a plain differentiable path).
    Raises:
        RuntimeError: under ``create_graph=True``; never returns a silently wrong result.
    """
    if _again(ctx)[0]:
        raise RuntimeError(
            f"{op}: double backward (create_graph=True, e.g. a gradient penalty or gradgradcheck) "
            f"is not supported by its closed-form backward; {instead}"
        )


def first_order_only(ctx: Any, grads: tuple[Any, ...], op: str) -> tuple[Any, ...]:
    """``grads``, marked when ordinary autograd around a ``torch.func`` transform tracks them
    (:func:`double_backward`'s second case) so that differentiating them raises, naming ``op``.

    The gradients themselves are right (``jacrev`` of a module whose parameters require grad,
    ``vmap(grad(f))``); only a second derivative through them — which a first-order closed form
    would give silently wrong — raises, when it is asked for.
    """
    if not _again(ctx)[1]:
        return grads
    msg = (f"{op}: its backward is first order only; a second derivative through "
           "torch.func.grad / vjp / jacrev of it is not supported")
    return tuple(_FirstOrderOnly.apply(g, msg) if isinstance(g, Tensor) else g for g in grads)


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward raises (see :func:`first_order_only`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, msg: str) -> Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # noqa: ARG004
        ctx.msg = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:  # noqa: ARG004
        # refuses every backward: it is reached only by a second derivative
        raise RuntimeError(ctx.msg)


def tracked_vjp(ctx: Any, fn: Callable[..., Tensor], inputs: Sequence[Any], grad: Tensor) -> tuple[Any, ...]:
    """The backward's result from ``fn(*inputs)`` in plain tracked ops (exact double backward).

    ``inputs`` are the Function's forward inputs in order (the saved, tracked tensors); the
    result has one entry per input: the gradient with a graph where ``ctx.needs_input_grad``,
    else ``None``.
    """
    want = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and ctx.needs_input_grad[i]]
    with torch.enable_grad():
        out = fn(*inputs)
    grads = torch.autograd.grad(out, [inputs[i] for i in want], grad, create_graph=True, allow_unused=True)
    res: list[Any] = [None] * len(inputs)
    for i, g in zip(want, grads, strict=True):
        res[i] = g
    return tuple(res)
