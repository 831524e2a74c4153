r"""Native (C) forward and backward of sparsemax and 1.5-entmax on contiguous CPU rows (internal).

sdpa-one-sided-eot Prop. 4.2–4.3. The kernels are ``attnopt/_native/sparse_maps.c``, built
on first use by :mod:`attnopt._native`; ``torch.get_num_threads()`` threads
(:func:`attnopt._native.parallel_rows`) claim runs of rows from a shared counter, so a thread
that a loaded machine deschedules does not hold up the call. Each row is a handful of
vectorized sweeps over a few kB that stay in the L1 cache, where the PyTorch-op search
(:mod:`.groups`) pays a
dozen streaming ops per cache block and a thread barrier after each. Per row, with
``z = x − max x`` (written once into the output):

* **1.5-entmax**, ``p = ([z − c]₊/2)²`` with ``‖[z − c]₊‖² = 4``, ``c ∈ [−2, 0]``: every sweep
  evaluates ``k = |S|``, ``s₁ = Σ_S v``, ``s₂ = Σ_S v²`` (``v = z − c``, ``S = {z > c}``) at a
  trial ``c``, and with them the sort algorithm's closed form on ``S`` (Peters et al., 2019),
  ``c_S = c + (s₂ − 4)/(s₁ + √(s₁² − k(s₂ − 4)))`` (the smaller root, written without
  cancellation). ``c`` is exact, and accepted, when it is the closed form of its own support:
  it was computed as the closed form of a support of the same size (the two sets are nested,
  so they are equal), or ``c_S`` rounds to ``c`` (entries tied at the threshold); a guard
  ``|s₂/4 − 1| ≤ 4096 ε`` rejects a closed form spoilt by rounding. Then ``p = v²/s₂``. The
  next trial is ``c_S``, else Newton's ``c + (‖v‖ − 2)‖v‖/s₁``, else bisection, always strictly
  inside the bracket of the root given by the signs of ``s₂ − 4``. No tolerance is involved
  (``entmax(..., tol)`` is not used here): the result is the exact map to rounding.
* **sparsemax**, ``p = [z − t]₊`` with ``Σ p = 1``: Michelot's algorithm from the lower bound
  ``t = −1`` (``t ← t + (s₁ − 1)/k``, the closed form on ``S``); exact once ``k`` stops changing.

Sums are vectorized in the input precision over blocks of 256 entries and carried in double.
A row whose search does not settle within ``max_iter`` sweeps is reported, and the caller
reruns it on the PyTorch path (never a silent wrong row).

Backward (the closed forms of :func:`._common.closed_form_backward`):
``∂L/∂x = s ⊙ (g − ⟨s, g⟩/⟨s, 1⟩)`` with ``s = √p`` (1.5-entmax) or ``s = 1_{p>0}`` (sparsemax).

The same kernels as ``torch.library`` ops (issue 30 item 2: a C kernel reached through PyTorch's
dispatcher, so that ``torch.compile``, ``torch.export``, the profiler and ``torch.func`` see one op):

* ``attnopt::sparse_map_fwd(x, alpha, max_iter) -> (p, theta, status)``: ``status`` (one int8 per
  row: 0 settled, 1 not settled within ``max_iter`` sweeps, 2 NaN / ``+inf``) replaces the
  ctypes wrapper's data-dependent ``redo`` index, so the op's output shapes follow from its
  input shapes alone (the fake implementation needs nothing more);
* ``attnopt::sparse_map_bwd(p, grad, alpha) -> dx``: the closed-form backward above;
* :func:`sparse_map`: ``p`` with autograd registered on the forward op (its backward is the
  backward op), for callers that want one differentiable op.

Both ops have CPU kernels only; other devices have no kernel registered (a clear dispatcher
error), and the library's routers never hand them a device tensor (they run the sort-based
closed forms of :mod:`.sort` there). In eager code the routers call the ctypes entry points (the
dispatcher's per-call cost matters at small sizes); while ``torch.compile`` / ``torch.export``
traces CPU tensors they call the ops, when :func:`ready` (the library built; dynamo runs the
lookup at trace time and keeps the answer as a constant, :func:`attnopt._native.ready`).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import require

__all__ = ["backward", "forward", "forward_status", "sparse_map", "sparse_map_bwd",
           "sparse_map_fwd", "ready", "usable"]

_LIB = "sparse_maps"
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def library_available() -> bool:
    """Whether the C kernels are built (no compiler or ``ATTNOPT_NATIVE=0``: False)."""
    return _native.library(_LIB) is not None


def usable(x: Tensor, dim: int) -> bool:
    """A float32/float64 CPU tensor reduced along its last dim (copied if not contiguous), and
    the kernel built."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() >= 1 and dim % x.dim() == x.dim() - 1
            and x.numel() > 0 and _native.has_storage(x) and _native.library(_LIB) is not None)


has_storage = _native.has_storage

def ready() -> bool:
    """Whether the C library is built (no compiler or ``ATTNOPT_NATIVE=0``: False), readable while
    ``torch.compile`` traces (:func:`attnopt._native.ready`); eager calls check :func:`usable`."""
    return _native.ready(_LIB)


_ptr = _native.pointer


@_native.untraced
def forward_status(
    x: Tensor, alpha: float, max_iter: int, *, in_place: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, θ, status)``: :func:`forward`'s C call, with one int8 ``status`` per row (0 settled,
    1 not settled within ``max_iter`` sweeps, 2 NaN / ``+inf``) instead of the ``redo`` index.

    The body of the ``attnopt::sparse_map_fwd`` op (below): no host read, output
    shapes from the input shape alone.
    """
    lib = _native.library(_LIB)
    assert lib is not None and x.dtype in _SUFFIX
    p = x if in_place and x.is_contiguous() else None
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    if p is None:
        p = torch.empty_like(x)
    theta = torch.empty((*x.shape[:-1], 1), dtype=x.dtype)
    status = torch.empty(rows, dtype=torch.int8)
    counter = torch.zeros(1, dtype=torch.int64)
    _check_sparse_map(x, p, theta, status, counter, rows, n)
    args = (_ptr(x), _ptr(p), _ptr(theta), _ptr(status), _ptr(counter), ctypes.c_int64(rows))
    if alpha == 2.0:
        fn = getattr(lib, f"sparsemax_fwd_{_SUFFIX[x.dtype]}")
    else:
        fn = getattr(lib, f"entmax15_fwd_{_SUFFIX[x.dtype]}")

    def call(_r0: int, _r1: int) -> None:  # every thread claims rows from the shared counter
        fn(*args, ctypes.c_int64(n), ctypes.c_int64(max_iter))

    _native.parallel_rows(call, rows, n)
    return p, theta, status


def forward(
    x: Tensor, alpha: float, max_iter: int, *, in_place: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, θ, redo)`` of sparsemax (``alpha = 2``) or 1.5-entmax along the last dim of ``x``.

    ``in_place=True`` writes ``p`` over a contiguous ``x`` (the kernels read each entry of a row
    before writing it, and later sweeps read only ``p``); the ``redo`` rows then hold a shifted
    copy of their input, not the input.

    ``θ`` (shape ``(..., 1)``) is the threshold of :func:`._common.map_from_threshold`:
    ``p = [(α−1)(x − max x) − θ]₊^{1/(α−1)}``. ``redo`` holds the flat indices of the rows whose
    search did not settle (their ``p`` and ``θ`` are to be recomputed by the caller).

    Raises:
        ValueError: NaN or ``+inf`` in ``x``.
    """
    p, theta, status = forward_status(x, alpha, max_iter, in_place=in_place)
    worst = int(status.max())  # one reduction for the common all-settled case
    if worst == 2:
        raise ValueError("scores must not contain NaN or +inf (use -inf to mask an entry)")
    if worst == 0:
        return p, theta, status.new_empty(0, dtype=torch.int64)
    return p, theta, (status == 1).nonzero().view(-1)


@_native.untraced
def backward(p: Tensor, grad: Tensor, alpha: float) -> Tensor:
    """``s ⊙ (g − ⟨s, g⟩/⟨s, 1⟩)`` along the last dim (``s = √p``, or ``1_{p>0}`` for ``alpha = 2``)."""
    lib = _native.library(_LIB)
    assert lib is not None and p.dtype in _SUFFIX
    p = p.contiguous()
    g = grad.to(p.dtype).contiguous()
    n = p.shape[-1]
    out = torch.empty_like(p)
    name = "sparsemax_bwd" if alpha == 2.0 else "entmax15_bwd"
    fn = getattr(lib, f"{name}_{_SUFFIX[p.dtype]}")
    rows = p.numel() // n
    counter = torch.zeros(1, dtype=torch.int64)
    _check_sparse_map(p, g, out, None, counter, rows, n)
    args = (_ptr(p), _ptr(g), _ptr(out), _ptr(counter), ctypes.c_int64(rows), ctypes.c_int64(n))

    def call(_r0: int, _r1: int) -> None:  # every thread claims rows from the shared counter
        fn(*args)

    _native.parallel_rows(call, rows, n)
    return out


def _check_sparse_map(
    a: Tensor, b: Tensor, c: Tensor, status: Tensor | None, counter: Tensor, rows: int, n: int,
) -> None:
    """What ``{sparsemax,entmax15}_{fwd,bwd}_*`` read and write: ``rows × n`` dense entries of ``a``, ``b``
    (forward: x, p; backward: p, g) and of ``c`` (backward: out; forward: θ, ``rows`` entries), ``rows``
    int8 status codes (forward), one int64 row counter."""
    kernel = "sparse_maps"
    require(kernel, "a", a, dtype=a.dtype, numel=rows * n)
    require(kernel, "b", b, dtype=a.dtype, numel=rows * n)
    require(kernel, "c", c, dtype=a.dtype, numel=rows if status is not None else rows * n)
    if status is not None:
        require(kernel, "status", status, dtype=torch.int8, numel=rows)
    require(kernel, "counter", counter, dtype=torch.int64, numel=1)


@torch.library.custom_op("attnopt::sparse_map_fwd", mutates_args=(), device_types="cpu")
def sparse_map_fwd(x: Tensor, alpha: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, θ, status)`` of sparsemax (``alpha = 2``) or 1.5-entmax along the last dim of ``x``.

    ``p`` and ``θ`` are always the map: rows the C search did not settle (``status`` != 0), or every
    row where the library cannot be used when the op runs, take the sort-based closed form
    (:data:`FALLBACK`) inside the op's body — a CPU op may read its own status — so a traced graph
    holds this one op and no selection."""
    if _native.library(_LIB) is None:
        p, theta = FALLBACK[0](x, alpha)
        rows = x.numel() // max(x.shape[-1], 1)
        return p.contiguous(), theta.contiguous(), torch.zeros(rows, dtype=torch.int8)
    p, theta, status = forward_status(x, alpha, max_iter)
    redo = status.nonzero().view(-1)
    if redo.numel():
        n = x.shape[-1]
        p_redo, theta_redo = FALLBACK[0](x.reshape(-1, n).index_select(0, redo), alpha)
        p.view(-1, n).index_copy_(0, redo, p_redo)
        theta.view(-1, 1).index_copy_(0, redo, theta_redo)
    return p, theta, status


#: The sort-based closed form ``(p, θ) = FALLBACK[0](x, alpha)`` along the last dim, which
#: :func:`sparse_map_fwd` runs for the rows its C search leaves: set by the router
#: (``regularized/_maps.py``), so that this leaf does not import another leaf.
FALLBACK: list[Callable[[Tensor, float], tuple[Tensor, Tensor]]] = []


@sparse_map_fwd.register_fake
def _(x: Tensor, alpha: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ARG001
    rows = x.numel() // max(x.shape[-1], 1)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((*x.shape[:-1], 1)), x.new_empty((rows,), dtype=torch.int8))


@torch.library.custom_op("attnopt::sparse_map_bwd", mutates_args=(), device_types="cpu")
def sparse_map_bwd(p: Tensor, grad: Tensor, alpha: float) -> Tensor:
    """The closed-form backward of :func:`sparse_map_fwd` along the last dim."""
    return backward(p, grad, alpha)


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
