r"""The sparse-map C kernels as ``torch.library`` ops: ``attnopt::sparse_map`` (internal).

issue 30 item 2: a C kernel reached through PyTorch's dispatcher, so that ``torch.compile``,
``torch.export``, the profiler and ``torch.func`` see one op. The op wraps the C entry points of
:mod:`attnopt.functional._sparse_native` (sparsemax / 1.5-entmax along the last dim of a
float32/float64 CPU tensor, sdpa-one-sided-eot Prop. 4.2–4.3):

* ``attnopt::sparse_map_fwd(x, alpha, max_iter) -> (p, theta, status)``: ``status`` (one int8 per
  row: 0 settled, 1 not settled within ``max_iter`` sweeps, 2 NaN / ``+inf``) replaces the
  ctypes wrapper's data-dependent ``redo`` index, so the op's output shapes follow from its
  input shapes alone (the fake implementation needs nothing more);
* ``attnopt::sparse_map_bwd(p, grad, alpha) -> dx``: the closed-form backward
  ``s ⊙ (g − ⟨s, g⟩/⟨s, 1⟩)`` (``s = √p``, or ``1_{p>0}`` for sparsemax);
* :func:`sparse_map`: ``p`` with autograd registered on the forward op (its backward is the
  backward op), for callers that want one differentiable op.

Both ops have CPU kernels only; other devices have no kernel registered (a clear dispatcher
error), and the library's routers never hand them a device tensor (they run the sort-based
closed forms of :mod:`._sparse_sort` there). Per-call cost against the ctypes call: see the
bench notes of issue 30 (``attnopt bench``-style timing in the branch's report).
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt.functional import _sparse_native

__all__ = ["sparse_map", "sparse_map_fwd", "sparse_map_bwd"]


@torch.library.custom_op("attnopt::sparse_map_fwd", mutates_args=(), device_types="cpu")
def sparse_map_fwd(x: Tensor, alpha: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, θ, status)`` of sparsemax (``alpha = 2``) or 1.5-entmax along the last dim of ``x``."""
    return _sparse_native.forward_status(x, alpha, max_iter)


@sparse_map_fwd.register_fake
def _(x: Tensor, alpha: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ARG001
    rows = x.numel() // max(x.shape[-1], 1)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((*x.shape[:-1], 1)), x.new_empty((rows,), dtype=torch.int8))


@torch.library.custom_op("attnopt::sparse_map_bwd", mutates_args=(), device_types="cpu")
def sparse_map_bwd(p: Tensor, grad: Tensor, alpha: float) -> Tensor:
    """The closed-form backward of :func:`sparse_map_fwd` along the last dim."""
    return _sparse_native.backward(p, grad, alpha)


@sparse_map_bwd.register_fake
def _(p: Tensor, grad: Tensor, alpha: float) -> Tensor:  # noqa: ARG001
    return torch.empty_like(p, memory_format=torch.contiguous_format)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    ctx.alpha = inputs[1]  # type: ignore[attr-defined]
    ctx.save_for_backward(output[0])


def _backward(ctx: torch.autograd.function.FunctionCtx, gp: Tensor, _gt: Tensor | None,
              _gs: Tensor | None) -> tuple[Tensor | None, None, None]:
    (p,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return torch.ops.attnopt.sparse_map_bwd(p, gp, ctx.alpha), None, None  # type: ignore[attr-defined]


sparse_map_fwd.register_autograd(_backward, setup_context=_setup_context)


def sparse_map(x: Tensor, alpha: float, max_iter: int = 1000) -> Tensor:
    """Sparsemax / 1.5-entmax of the last dim by the C kernel as one differentiable op.

    Raises:
        ValueError: NaN or ``+inf`` in ``x``, or a row the kernel did not settle (the library's
            routers rerun those rows on the PyTorch path instead).
    """
    p, _, status = torch.ops.attnopt.sparse_map_fwd(x, alpha, max_iter)
    if not torch.compiler.is_compiling():  # (a host read: eager CPU only)
        worst = int(status.max()) if status.numel() else 0
        if worst == 2:
            raise ValueError("scores must not contain NaN or +inf (use -inf to mask an entry)")
        if worst == 1:
            raise ValueError(f"the C search did not settle within max_iter={max_iter} sweeps")
    out: Tensor = p
    return out
