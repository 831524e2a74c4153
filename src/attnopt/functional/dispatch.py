r"""Size-based dispatch between a fused *materialized* path and the O(N)-memory *streaming* path.

Every mechanism with two implementations takes ``impl="auto" | "materialized" | "streaming"``:

* ``"materialized"`` forms the ``Nq × Nk`` scores once and runs the fewest passes the math
  allows (one autograd node with a closed-form backward); fastest at short sequences.
* ``"streaming"`` never holds ``Nq × Nk`` (flash-style or query-blocked passes); needed at
  long sequences, and faster there.
* ``"auto"`` picks ``"materialized"`` when :func:`choose_impl` says so:
  ``B·H·Nq·Nk <= CROSSOVERS[mechanism][dtype]`` (the size of one score matrix).

The crossover is a number of score entries, not a length; the crossovers are the
``crossovers`` field of the one threshold table :mod:`attnopt.functional._thresholds` (with every
other size rule of the families' routers: overridable in code, in tests and by the environment).
They were measured forward+backward at d = 64, float32, one CPU thread
(``attnopt bench --only small_n``, which times both paths of every dispatched row: re-measure
there). Both paths compute the same function up to float rounding; both are tested against the
float64 reference.

Inference (grad mode off, or no input that requires grad) runs a no-grad forward on the
materialized side, which saves nothing (DNAS / Sinkhorn / HNAS without a mask, chunk by chunk
above ``dnas_materialized_chunk_entries``; sparsemax / 1.5-entmax with the C map in place on the
scores). ``last_dispatch`` still says ``"materialized"`` for them.

The choice of the last call is observable: :data:`last_dispatch` maps a mechanism name to
``"materialized"`` or ``"streaming"`` — or, inside :func:`backend`, to ``"reference"`` (the plain
PyTorch reference ran: ``backend("reference")``; no C kernel runs anywhere in such a block) or
``"cpu"`` (``backend("cpu")``: the CPU kernels and fast paths as ``auto`` picks them; tensors
off the CPU are refused) — or ``"triton"`` when the GPU kernels of :mod:`attnopt.functional.triton`
ran (CUDA tensors with Triton installed, or ``backend("triton")``).

Off the CPU (and while ``torch.compile`` traces) the same routers run device-agnostic code with
no host sync: see :func:`attnopt._validation.host_readable`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, ParamSpec, TypeVar

import torch

from attnopt import _backend as _backend_cell
from attnopt.functional._thresholds import THRESHOLDS

__all__ = [
    "BACKENDS", "Backend", "Impl", "CROSSOVERS", "backend", "check_impl", "choose_impl",
    "current_backend", "last_dispatch", "profiled", "record", "use_reference",
]

Impl = Literal["auto", "materialized", "streaming"]
_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Implementation families :func:`backend` can force, as ``torch.nn.attention.sdpa_kernel`` does
#: for SDPA: ``"auto"`` lets each family's router choose; ``"reference"`` runs the plain-PyTorch
#: reference (any device); ``"cpu"`` the CPU kernels; ``"triton"`` the GPU kernels.
Backend = Literal["auto", "reference", "cpu", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cpu", "triton")

# a module-level cell (not a ContextVar): torch.compile guards on it like any global; it lives in
# attnopt._backend so that attnopt._native can switch the C kernels off under "reference"
_BACKEND: list[str] = _backend_cell.BACKEND


def current_backend() -> str:
    """The backend forced by the innermost :func:`backend` block (``"auto"`` outside any)."""
    return _BACKEND[0]


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Force one implementation family inside a ``with`` block (restored on exit).

    Example::

        with attnopt.backend("reference"):
            out = attnopt.doubly_normalized_attention(q, k, v)
        attnopt.functional.dispatch.last_dispatch["doubly_normalized"]  # names what ran

    Args:
        name: one of :data:`BACKENDS`.
    Raises:
        ValueError: unknown ``name``.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend name must be one of {BACKENDS}, got {name!r}")
    previous = _BACKEND[0]
    _BACKEND[0] = name
    try:
        yield
    finally:
        _BACKEND[0] = previous

#: Largest ``B·H·Nq·Nk`` at which ``auto`` materializes, per mechanism and dtype
#: (``"half"`` = float16/bfloat16, computed in float32 by the materialized path): the
#: ``crossovers`` field of the one threshold table, :mod:`attnopt.functional._thresholds`
#: (the same dict object; its measurements are in the bench, ``attnopt bench --only small_n``).
CROSSOVERS: dict[str, dict[str, int]] = THRESHOLDS.crossovers

#: The path taken by the last call of each mechanism (``"materialized"`` or ``"streaming"``).
last_dispatch: dict[str, str] = {}


def check_impl(impl: object) -> str:
    """Validate an ``impl`` argument; returns it."""
    if impl not in ("auto", "materialized", "streaming"):
        raise ValueError(f"impl must be 'auto', 'materialized' or 'streaming', got {impl!r}")
    return str(impl)


def _dtype_key(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    return "float64" if dtype == torch.float64 else "float32"


def choose_impl(
    mechanism: str, *, nq: int, nk: int, batch: int = 1, dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> str:
    """The path ``impl="auto"`` takes for these sizes (``impl`` other than auto is returned as is).

    Args:
        mechanism: a key of :data:`CROSSOVERS` (``"doubly_normalized"`` for DNAS K = 1,
            ``"sinkhorn"`` for K >= 2, ``"hybrid_normalized"``, ``"sparse"`` for sparsemax /
            entmax attention, ``"generalized"`` for a full bias under autograd, ``"kernel"``
            for bounded feature-map kernels, e.g. IKA / IKAN).
        nq, nk: query and key lengths.
        batch: product of the batch dimensions (B·H).
        dtype: input dtype.
        impl: ``"auto"``, ``"materialized"`` or ``"streaming"``.
    Returns:
        ``"materialized"`` or ``"streaming"``.
    Raises:
        ValueError: unknown ``mechanism`` or ``impl``.
    """
    check_impl(impl)
    if mechanism not in CROSSOVERS:
        raise ValueError(f"unknown mechanism {mechanism!r}; known: {sorted(CROSSOVERS)}")
    if impl != "auto":
        return impl
    small = batch * nq * nk <= CROSSOVERS[mechanism][_dtype_key(dtype)]
    return "materialized" if small else "streaming"


def record(mechanism: str, path: str) -> str:
    """Store ``path`` in :data:`last_dispatch` and return it (under ``backend("cpu")`` /
    ``backend("reference")`` the entry names the backend; the returned path is the size class
    the caller branches on)."""
    name = _BACKEND[0]
    last_dispatch[mechanism] = name if name in ("cpu", "reference") else path
    return path


def use_reference(mechanism: str, x: torch.Tensor) -> bool:
    """Whether ``mechanism`` must run its plain-PyTorch reference now (``backend("reference")``);
    records ``"reference"`` then. Under ``backend("cpu")`` a tensor off the CPU is an error.

    Every public op asks this first, before any size or device rule of its router.

    Raises:
        ValueError: ``backend("cpu")`` with ``x`` not on the CPU.
    """
    name = _BACKEND[0]
    if name == "reference":
        last_dispatch[mechanism] = "reference"
        return True
    if name == "cpu":
        if x.device.type != "cpu":
            raise ValueError(
                f"attnopt.backend('cpu') runs the CPU kernels, but {mechanism} got tensors on {x.device}; "
                "use backend('reference') or 'auto' there"
            )
        last_dispatch[mechanism] = "cpu"
    return False


def profiled(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Name the calls of the public op ``fn`` ``attnopt::<name>`` in ``torch.profiler`` traces.

    While a profiler records (eager), each call is one ``record_function`` range holding the
    aten ops, C kernels and autograd nodes it ran, as PyTorch's own ops appear; otherwise the
    wrapper costs one flag read (~0.1 µs). Compiled and exported graphs name the
    ``torch.ops.attnopt`` ops they hold instead (the range is not traced).
    """
    name = f"attnopt::{fn.__name__}"

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
            return fn(*args, **kwargs)
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return call
