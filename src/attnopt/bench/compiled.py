"""Bench rows for the opt-in ``torch.compile`` path (:func:`attnopt.functional.compiled`).

Case: B·H = 8, N = 256, d = 64, float32, forward+backward, one CPU thread; each mechanism
eager (baseline) vs compiled (inductor), best thread CPU time after the compiling call,
whose wall time is in the note. Full mode only (compiling takes about a minute per function
here); ``--quick`` and a machine without a C++ compiler give one skipped row saying why.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from attnopt.bench._harness import BenchContext, Measurement, bench_suite
from attnopt.bench.small_n import _best, _closure
from attnopt.functional._compiled import compiled, inductor_available
from attnopt.functional.doubly_normalized import hybrid_normalized_attention
from attnopt.functional.generalized import generalized_attention
from attnopt.functional.regularized import regularized_attention
from attnopt.functional.regularized.regularizers import SquaredL2
from attnopt.nn.preference import T5RelativePreference

SUITE = "compiled"
H, N, D = 8, 256, 64
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _fns(device: str) -> dict[str, Fn]:
    w = torch.tensor(0.5, device=device, requires_grad=True)
    t5 = T5RelativePreference(H).to(device)
    return {
        "hnas K=1": lambda q, k, v: hybrid_normalized_attention(q, k, v, w),
        "sparsemax": lambda q, k, v: regularized_attention(q, k, v, regularizer=SquaredL2()),
        "generalized T5 (learned bias)": lambda q, k, v: generalized_attention(
            q, k, v, log_preference=t5(q.shape[-2], k.shape[-2])),
    }


@bench_suite(SUITE)
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """Eager vs ``torch.compile`` per mechanism (full mode, where inductor can build)."""
    case = f"B*H={H} N={N} d={D} fwd+bwd"
    if ctx.quick or not inductor_available(ctx.device):
        why = "--quick" if ctx.quick else "no compiler for inductor on this device"
        yield Measurement(SUITE, case, "compiled", float("nan"), note=f"skipped: {why}")
        return
    threads = torch.get_num_threads()
    if not ctx.device.startswith("cuda"):
        torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        qkv = tuple(torch.randn(1, H, N, D, generator=g).to(ctx.device).requires_grad_() for _ in range(3))
        for name, fn in _fns(ctx.device).items():
            case_n = f"{case}: {name}"
            cpu, wall = _best(_closure(fn, qkv, True), ctx.repeat, ctx.device)
            yield Measurement(SUITE, case_n, "eager", cpu, baseline=True, note=f"wall {wall * 1e3:.2f} ms")
            fast = compiled(fn)
            t0 = time.perf_counter()
            _closure(fast, qkv, True)()
            build = time.perf_counter() - t0
            cpu, wall = _best(_closure(fast, qkv, True), ctx.repeat, ctx.device)
            yield Measurement(SUITE, case_n, "compiled (inductor)", cpu,
                              note=f"first call (compiling) {build:.0f} s; wall {wall * 1e3:.2f} ms")
    finally:
        torch.set_num_threads(threads)
