"""Bench rows for the autoregressive (``causal="prefix"``) DNAS / Sinkhorn-K / HNAS of a causal decoder.

Rows per case (N, fwd or fwd+bwd, H = 8, d = 64, float32, causal self-attention): SDPA with
``is_causal=True`` (baseline), ``doubly_normalized_attention(is_causal=True)`` — the prefix
variant, materialized (:mod:`attnopt.functional.doubly_normalized.prefix`) — with K = 1 and K = 3,
``hybrid_normalized_attention`` (w = 0.5, K = 1), and the masked plan
(``causal="plan"``, the O(N)-memory fast paths; it leaks later queries) as the price of the old
behaviour. Sinkhorn-K prefix solves one problem per row (``O(K N³)`` time): its row is skipped
where the estimated time or memory is out of reach (the note says so).

Run alone: ``attnopt bench --only dn_causal`` (sizes: ``ATTNOPT_BENCH_DN_CAUSAL_SIZES=256,1024``).
No figures here: they go in the bench output.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.bench.doubly_normalized import D, H, _closure, _inputs  # the same inputs (B = 1, H = 8, d = 64)
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention

#: Sinkhorn-K prefix rows above this many score-entry updates (K · H · N³, ×3 with the backward) are
#: skipped: N = 256 with backward runs in seconds; N = 512 forward alone took minutes on a CPU thread
SINKHORN_LIMIT = 3 * 3 * H * 256**3


def _impls() -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "sdpa causal": lambda q, k, v, w: F.scaled_dot_product_attention(q, k, v, is_causal=True),  # noqa: ARG005
        "dnas K=1 prefix": lambda q, k, v, w: doubly_normalized_attention(q, k, v, is_causal=True),  # noqa: ARG005
        "sinkhorn K=3 prefix": lambda q, k, v, w: doubly_normalized_attention(  # noqa: ARG005
            q, k, v, iterations=3, is_causal=True),
        "hnas K=1 prefix": lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w, is_causal=True),
        "dnas K=1 plan (leaks)": lambda q, k, v, w: doubly_normalized_attention(  # noqa: ARG005
            q, k, v, is_causal=True, causal="plan"),
    }


def memory_factory(impl: str, n: int, backward: bool, device: str = "cpu") -> Callable[[], None]:
    """Inputs for one row, built in the memory subprocess; returns the closure to measure."""
    return _closure(_impls()[impl], _inputs(n, backward, device), backward)


def _sizes(ctx: BenchContext) -> list[int]:
    env = os.environ.get("ATTNOPT_BENCH_DN_CAUSAL_SIZES")
    if env:
        return [int(x) for x in env.split(",")]
    return [256] if ctx.quick else [256, 1024, 2048]


@bench_suite("dn_causal")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """Autoregressive DNAS / Sinkhorn-3 / HNAS vs causal SDPA and the (leaking) masked plan."""
    for n in _sizes(ctx):
        repeat, warmup = (2 if ctx.quick else ctx.repeat, 1) if n <= 1024 else (1, 0)
        for backward in (False, True):
            case = f"N={n} H={H} d={D} causal {'fwd+bwd' if backward else 'fwd'}"
            inputs = _inputs(n, backward, ctx.device)
            for i, (name, fn) in enumerate(_impls().items()):
                note = "" if repeat > 1 else "single timed run (large N)"
                if name.startswith("sinkhorn") and 3 * H * n**3 * (3 if backward else 1) > SINKHORN_LIMIT:
                    yield Measurement("dn_causal", case, name, float("nan"), None,
                                      note=f"skipped: O(K H N^3) = {3 * H * n**3:.1e} score updates per call")
                    continue
                secs = time_call(_closure(fn, inputs, backward), repeat=repeat, warmup=warmup,
                                 device=ctx.device)
                peak = None
                if ctx.memory:
                    args = dict(impl=name, n=n, backward=backward, device=ctx.device)
                    peak = peak_memory_mb("attnopt.bench.dn_causal:memory_factory", args, device=ctx.device)
                yield Measurement("dn_causal", case, name, secs, peak, baseline=i == 0, note=note)
