r"""Size-based dispatch between a fused *materialized* path and the O(N)-memory *streaming* path.

Every mechanism with two implementations takes ``impl="auto" | "materialized" | "streaming"``:

* ``"materialized"`` forms the ``Nq × Nk`` scores once and runs the fewest passes the math
  allows (one autograd node with a closed-form backward); fastest at short sequences.
* ``"streaming"`` never holds ``Nq × Nk`` (flash-style or query-blocked passes); needed at
  long sequences, and faster there.
* ``"auto"`` picks ``"materialized"`` when :func:`choose_impl` says so:
  ``B·H·Nq·Nk <= CROSSOVERS[mechanism][dtype]`` (the size of one score matrix).

The crossover is a number of score entries, not a length. DNAS / Sinkhorn / HNAS (the fused
kernel of :mod:`._dnas_fused`: chunked over batch × heads, ``E`` recomputed in the backward,
O(N) saved state) measured forward+backward against the O(N) streaming path (d = 64, float32,
one CPU thread, ``attnopt bench --only small_n``, loaded 2-core machine): fused 1.27× / 1.26×
SDPA vs streaming 1.92× / 1.96× (DNAS, B·H = 64 and 8 at N = 512), and still 1.39× vs 1.80× at
B·H·N² = 2^26 (B·H = 64, N = 1024); at d = 16 (B·H = 128, N = 513) 1.8× vs 2.2×. Its memory is
one chunk's workspace plus O(N) per head, so the default 2^26 is where measuring stopped:
larger problems stream. With the native C passes (:mod:`._dnas_native`: K = 1, float32, CPU) the
fused kernel runs from B·H·N² = 2^18 and measured 1.08× (DNAS) / 1.10× (HNAS) SDPA at B·H = 8,
N = 512 and 0.8× at N = 256 (PyTorch path: 1.57× / 2.25×, 1.62× / 1.86×). Sparse / generalized:
the materialized path stopped winning at the same ``B·H·N²``
for B·H = 8 and 64 (faster at 8·512² and 64·256², slower at 8·1024² and 64·512²). Same values on
every device (no GPU was measured). Both paths compute the same function up to float
rounding; both are tested against the float64 reference.

Inference (grad mode off, or no input that requires grad) runs a no-grad forward on the
materialized side, which saves nothing: DNAS / Sinkhorn / HNAS without a mask up to
``B·H·Nq·Nk = 2^20`` (:data:`._dnas_materialized.NO_GRAD_MAX_ENTRIES`: in-place PyTorch ops, or one
C pass for K = 1 in float32), sparsemax / 1.5-entmax with the C map in place on the scores at
every size (:data:`._sparse_attention_fused.NO_GRAD_MIN_ENTRIES`). ``last_dispatch`` still says
``"materialized"`` for them.

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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from attnopt import _backend as _backend_cell

__all__ = [
    "BACKENDS", "Backend", "Impl", "CROSSOVERS", "backend", "check_impl", "choose_impl",
    "current_backend", "last_dispatch", "record", "use_reference",
]

Impl = Literal["auto", "materialized", "streaming"]

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
#: (``"half"`` = float16/bfloat16, computed in float32 by the materialized path).
CROSSOVERS: dict[str, dict[str, int]] = {
    "doubly_normalized": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
    "sinkhorn": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
    "hybrid_normalized": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
    "sparse": {"float32": 1 << 24, "float64": 1 << 24, "half": 1 << 23},
    "generalized": {"float32": 1 << 20, "float64": 1 << 20, "half": 1 << 20},
    # kernel: the fused Fourier node beat the chunked path fwd+bwd at every size measured up to
    # B·H·N² = 64·1024² (ikan R=16: 1.70× vs 2.88× SDPA there); 2^24 keeps the N = 64–512 range.
    # Re-measured (attention fwd+bwd incl. the kernel sampling, float32, 1 thread, loaded 2-core
    # machine, fused vs chunked ms, extra peak RSS): ika-s / ikan B·H = 128, N = 512, d = 16
    # (2^25, the train step's size) 345–348 vs 343–361 / 373 vs 352, +0.55 vs +0.53 GiB; B·H = 8,
    # d = 64: N = 1024 111 vs 105, N = 2048 410 vs 327 / 424 vs 329; B·H = 64, N = 1024, d = 64
    # (2^26) 866 vs 1193 / 1130 vs 2010, +1.15 vs +1.02 GiB. Train step (E = 64, H = 4, B = 32,
    # N = 512) with 2^26: ika-s 2.55–2.60× -> 2.54–2.64× softmax, ikan 2.61–2.68× -> 2.55–2.65×,
    # linear 2.82–2.90× -> 3.5–3.6×: no gain at the train step's size, so 2^24 stays. Since both
    # paths run the Nq×Nk passes by cache-sized blocks (._kernel_chunked) the train step at
    # N = 512 is the same either way (2^24 vs 2^30: ika-s 1.35× vs 1.30×, ikan 1.38× vs 1.36×,
    # mikan 1.36× vs 1.36× softmax): the crossover now only picks where the features are computed
    "kernel": {"float32": 1 << 24, "float64": 1 << 24, "half": 1 << 23},
}

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
