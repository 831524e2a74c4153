r"""Every size threshold of :mod:`attnopt.functional` in one table (internal; overridable).

A family's router (its ``__init__.py``) and its implementations read their size rules from the
one live instance :data:`THRESHOLDS` *at call time*, so a change is seen by the next call:

* in code, for a block: ``with overrides(dnas_native_min_entries=0): ...`` (restored on exit);
* in a test: ``monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 0)``;
* for a process: the environment variable ``ATTNOPT_THRESHOLDS``, read once at import, e.g.
  ``ATTNOPT_THRESHOLDS="dnas_native_min_entries=0,dnas_materialized_chunk_entries=65536"``.

The per-mechanism crossovers between a materialized and a streaming path
(:data:`attnopt.functional.dispatch.CROSSOVERS`, ``impl="auto"``) are the field
:attr:`Thresholds.crossovers` (the same dict object).

Units. ``*_entries`` count score entries ``B·H·Nq·Nk`` (or of one chunk); ``*_head_scores``
count ``Nq·Nk`` of one head; ``*_elements`` count live tensor elements; ``*_bytes`` bytes. A
threshold trades speed against memory or cache size; where it was measured is said next to it
(the figures themselves live in the bench output, ``attnopt bench --only small_n``, and the
notes; re-measure on your machine and override). Thresholds change which implementation runs,
never the result beyond float rounding: every path is tested against the float64 reference.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from attnopt import _native

__all__ = ["THRESHOLDS", "Thresholds", "overrides"]


def _crossovers() -> dict[str, dict[str, int]]:
    return {
        "doubly_normalized": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
        "sinkhorn": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
        "hybrid_normalized": {"float32": 1 << 26, "float64": 1 << 25, "half": 1 << 25},
        "sparse": {"float32": 1 << 24, "float64": 1 << 24, "half": 1 << 23},
        "generalized": {"float32": 1 << 20, "float64": 1 << 20, "half": 1 << 20},
        # kernel: the fused Fourier node beat the chunked path fwd+bwd at every size measured up to
        # B·H·N² = 64·1024²; both paths run the Nq×Nk passes by cache-sized blocks, so the
        # crossover only picks where the features are computed (2^24 keeps N = 64–512 fused)
        "kernel": {"float32": 1 << 24, "float64": 1 << 24, "half": 1 << 23},
    }


@dataclass
class Thresholds:
    """The size thresholds, one field each (see the module docstring for units and overrides)."""

    #: ``impl="auto"``: largest ``B·H·Nq·Nk`` that runs materialized, per mechanism and dtype
    #: (``"half"`` = float16/bfloat16). Measured fwd+bwd, d = 64, one CPU thread (bench small_n).
    crossovers: dict[str, dict[str, int]] = field(default_factory=_crossovers)

    # -- doubly_normalized/ ------------------------------------------------------------------------
    #: materialized kernel (``doubly_normalized/materialized.py``): score entries per chunk of
    #: (batch, head) slices (at least one head), so that the ``Nq × Nk`` temporaries of one chunk
    #: stay in cache (one piece at the small-N bench sizes, one head per chunk at N = 1024, where
    #: the unchunked kernel ran about half as fast); also the largest problem the one-call C
    #: no-grad pass (``cpu.no_grad_small``) runs
    dnas_materialized_chunk_entries: int = 1 << 20
    #: from this many score entries in one piece (``G·Nq·Nk``) the no-grad Sinkhorn-K forward of
    #: ``doubly_normalized/materialized.py`` runs its later steps as scaling vectors (two
    #: matrix-vector products per iteration) instead of rewriting ``E`` in place (four passes):
    #: the passes won at 8·64², the vectors from 8·256² (one thread, d = 64)
    dnas_no_grad_vector_entries: int = 1 << 17
    #: from this many score entries the C passes (``doubly_normalized/cpu.py``: DNAS / HNAS /
    #: Sinkhorn-K, float32, CPU) run instead of the probability-domain kernel (measured fwd+bwd,
    #: d = 64, 1 thread: equal at 64·64², the C passes ahead from 8·256²)
    dnas_native_min_entries: int = 1 << 18
    #: score entries per thread in one chunk of the C passes (``S`` and ``dP`` of the backward
    #: fit a 2 MiB L2 together; 2^18 ran faster than 2^20 at N = 512, d = 16)
    dnas_cpu_chunk_entries: int = 1 << 18
    #: rows per block of the blocked streaming passes (``doubly_normalized/streaming.py``)
    dnas_streaming_block: int = 256
    #: live elements of one chunk of the autoregressive Sinkhorn-K prefix rows
    #: (``doubly_normalized/prefix.py``): Python-loop overhead against temporaries' size
    dn_prefix_chunk_elements: int = 1 << 22

    # -- regularized/ (sparsemax / entmax maps and attention) ----------------------------------------
    #: from this many scores ``B·H·Nq·Nk`` the materialized sparsemax / 1.5-entmax attention
    #: (``regularized/materialized.py``) runs the C map (``regularized/cpu.py``) on the scores
    #: instead of the in-place PyTorch search (C ahead from 2^21 at one and two threads, behind at
    #: two threads on small blocks)
    sparse_native_min_entries: int = 1 << 21
    #: without autograd the C map runs in place on the scores from this many entries (nothing
    #: saved, no second ``N × N`` buffer; faster at every size measured, hence 0)
    sparse_no_grad_native_min_entries: int = 0
    #: entries per row block of the materialized attention's threshold search (fits the L2 cache)
    sparse_row_block_entries: int = 1 << 16
    #: live elements of one query block of the streaming attention (``regularized/streaming.py``)
    sparse_streaming_block_elements: int = 1 << 22
    #: entries per row block of the maps' row-blocked CPU backward (``regularized/groups.py``)
    sparse_backward_block_entries: int = 1 << 16
    #: entries per row block of the α-entmax CPU threshold search (``regularized/search.py``)
    entmax_block_entries: int = 1 << 18
    #: rows shorter than this take the dense map search, not the group search
    #: (``regularized/groups.py``: the dense search is already cheap)
    sparse_groups_min_row: int = 256
    #: entries per row block of the group search (fits the L2 cache, so the gathers hit it)
    sparse_groups_block_entries: int = 1 << 20

    # -- generalized/ (softmax with an additive bias: T5, ALiBi, masks) -----------------------------
    #: ``B·H·Nq·Nk`` up to which ``auto`` runs a relative-position bias (T5's table, ALiBi's offsets)
    #: under autograd by the whole-call C path (``generalized/cpu.py``: ``fused_attention``, the
    #: forward one C call, the backward one); ``last_dispatch["generalized_kernel"] == "fused"``
    generalized_wholecall_below: int = 1 << 23
    #: ... and one head's ``Nq·Nk`` at most this (at N = 512 a head's E, dP, dS no longer share L2)
    generalized_wholecall_max_head_scores: int = 1 << 16
    #: ``B·H·Nq·Nk`` at or below which ``auto`` hands a full bias under autograd to SDPA itself
    #: (a Python node's per-call cost made it 1.2–2× SDPA with the same bias at B·H = 8, N = 64–128)
    generalized_sdpa_below: int = 1 << 17
    #: the same bound for a bias that needs a gradient when the node's C passes run
    generalized_sdpa_below_learned_native: int = 1 << 14
    #: ``B·H·Nq·Nk`` up to which ``auto`` takes the materialized node for a *constant* full bias when
    #: its C passes run (else ``crossovers["generalized"]``): O(chunk) memory, ahead of the flash
    #: kernel at every size measured (where measuring stopped)
    generalized_native_crossover: int = 1 << 26
    #: ... provided one head's ``Nq·Nk`` is at least this (below, the flash kernel reads strided heads
    #: in place while the node copies them)
    generalized_native_min_head_scores: int = 1 << 16
    #: one head's ``Nq·Nk`` from which a forward-only call takes the node's C passes, not streaming
    generalized_native_forward_min_head_scores: int = 1 << 18
    #: bytes of one chunk's ``Nq × Nk`` score block in the PyTorch node (``generalized/materialized.py``;
    #: half a 2 MiB L2: ``dP`` sits beside it)
    generalized_chunk_bytes: int = 1 << 20
    #: bytes of scores per thread in one chunk of the C passes (``generalized/cpu.py``: ``S`` and ``dP``
    #: of the backward share the L2)
    generalized_cpu_chunk_bytes: int = 1 << 20
    #: largest ``B·H·Nq·Nk`` bytes of ``P`` always saved for the backward (above: recomputed per chunk,
    #: in the PyTorch node when the head dimension is below 64, in the C passes at any)
    generalized_save_bytes: int = 1 << 24

    # -- ot/ --------------------------------------------------------------------------------------
    #: elements per chunk of the exact log-sum-exp that ``log_matmul_exp`` (``ot/reference.py``)
    #: recomputes for entries whose shifted matmul underflowed
    ot_gather_elements: int = 1 << 22

    # -- kernel/ (IKA, IKAN, RBF, periodic, linear mode, the spectral sampler) ----------------------
    #: logits held at once by the query-chunked quadratic path in plain ops (``kernel/__init__.py``)
    kernel_quadratic_chunk_elements: int = 1 << 24
    #: score blocks of the exp-free (direct) path in plain ops (measured best on CPU) ...
    kernel_direct_chunk_elements: int = 1 << 20
    #: ... but at least 64 query rows a block up to this many scores (fewer, smaller matmuls cost more)
    kernel_direct_max_elements: int = 1 << 22
    #: scores per block of the blocked feature-kernel node (``kernel/chunked.py``; 2^16–2^18 fastest
    #: at N = 512, d = 16 with a 2 MiB L2)
    kernel_block_elements: int = 1 << 18
    #: up to this many scores (all heads) the feature-kernel node runs one block and keeps ``F``,
    #: ``W`` for the backward
    kernel_whole_elements: int = 1 << 20
    #: off the CPU (no small cache to fit, launches cost): whole up to this many scores, blocks of
    #: this size beyond (not measured on a GPU)
    kernel_device_block_elements: int = 1 << 24
    #: ``B·H·Nq·Nk`` up to which the fused Fourier node takes its whole-call C path
    #: (``kernel/fourier.py``: forward and backward one C call each) ...
    kernel_wholecall_below: int = 1 << 22
    #: ... and one head's ``Nq·Nk`` at most this (N = 1024 loses)
    kernel_wholecall_max_head_scores: int = 1 << 18
    #: linear mode (``kernel/linear.py``): minimum key rows per chunk ...
    kernel_linear_key_chunk: int = 128
    #: ... chunks hold about this many state-sized entries
    kernel_linear_chunk_elements: int = 1 << 19
    #: linear mode, causal: query rows per prefix-sum chunk
    kernel_linear_causal_chunk: int = 128
    #: periodic (Expsin) node (``kernel/periodic.py``): bytes of one chunk's ``Nq × Nk`` block (the
    #: backward holds three such blocks at once)
    periodic_chunk_bytes: int = 1 << 18
    #: largest ``B·H·Nq·Nk`` bytes for which the periodic node saves ``θ`` and ``W`` rather than
    #: recomputing them
    periodic_save_bytes: int = 1 << 23
    #: with more than one torch thread the spectral sampler's C path (``kernel/spectral_cpu.py``,
    #: one thread) takes samples of at most this many base points; above, the PyTorch node's
    #: batched matmuls split over the threads catch up
    spectral_threaded_max_points: int = 1024

    # -- outside functional/ ------------------------------------------------------------------------
    #: largest ``Nq·Nk`` for which ``attnopt.nn.T5RelativePreference`` caches a flat offset index and
    #: index-adds the backward through it (3–4× faster than the strided Toeplitz copy at N = 512);
    #: above, the O(Nq + Nk) strided route keeps the cache small
    t5_gather_limit: int = 1 << 20
    #: MEM solver (``attnopt.dual``): largest ``K·Q·n²`` solved by a direct LU; above, conjugate
    #: gradients to the tolerance
    mem_direct_max_entries: int = 1 << 21
    #: the C kernels (``attnopt._native.parallel_rows``): a call with fewer entries (rows × row
    #: length) runs on one thread; above, on ``torch.get_num_threads()`` threads
    native_parallel_min_entries: int = 1 << 16


#: The live table every router reads.
THRESHOLDS = Thresholds()
# attnopt._native reads it too (native_parallel_min_entries); it cannot import this module (its
# package imports every family, which import attnopt._native), so the table is handed to it here
_native.TABLE[:] = [THRESHOLDS]

_FIELDS = {f.name for f in dataclasses.fields(Thresholds) if f.name != "crossovers"}


def _check(name: str, value: object) -> int:
    if name not in _FIELDS:
        raise ValueError(f"unknown threshold {name!r}; known: {sorted(_FIELDS)}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"threshold {name} must be a non-negative int, got {value!r}")
    return value


@contextmanager
def overrides(**values: int) -> Iterator[Thresholds]:
    """Set some thresholds of :data:`THRESHOLDS` inside a ``with`` block (restored on exit).

    Raises:
        ValueError: an unknown name or a value that is not a non-negative int.
    """
    checked = {name: _check(name, value) for name, value in values.items()}
    saved = {name: getattr(THRESHOLDS, name) for name in checked}
    for name, value in checked.items():
        setattr(THRESHOLDS, name, value)
    try:
        yield THRESHOLDS
    finally:
        for name, value in saved.items():
            setattr(THRESHOLDS, name, value)


def _from_environment(text: str) -> None:
    """Apply ``ATTNOPT_THRESHOLDS`` (``name=int,name=int``) to :data:`THRESHOLDS`."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"ATTNOPT_THRESHOLDS: expected name=int, got {item!r}")
        try:
            number = int(value.strip(), 0)
        except ValueError:
            raise ValueError(f"ATTNOPT_THRESHOLDS: {name.strip()} needs an int, got {value!r}") from None
        setattr(THRESHOLDS, name.strip(), _check(name.strip(), number))


_from_environment(os.environ.get("ATTNOPT_THRESHOLDS", ""))
