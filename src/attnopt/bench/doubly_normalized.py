"""Bench rows for doubly-normalized attention (DNAS K = 1, 3; HNAS) vs SDPA and a materialized peer.

Rows per case (N, fwd or fwd+bwd, H = 8, d = 64, float32): SDPA (baseline), our O(N)
``doubly_normalized_attention`` with K = 1 and K = 3, ``hybrid_normalized_attention``
(w = 0.5, K = 1), and :func:`materialized_sinkhorn_peer` — the peer: a materialized
log-domain Sinkhorn in the style of the public "sinkformers" code (N × N scores, K
log-sum-exp normalizations, autograd through everything). The peer is skipped where its
estimated footprint exceeds 12 GB (or the memory available now); the row's note says so.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention

H, D = 8, 64
PEER_LIMIT_GB = 12.0


def materialized_sinkhorn_peer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iterations: int
) -> torch.Tensor:
    """THE PEER (not our implementation): sinkformers-style materialized log-domain Sinkhorn."""
    log_p = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    for _ in range(iterations):
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return torch.exp(log_p) @ v


def _impls() -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "sdpa": lambda q, k, v, w: F.scaled_dot_product_attention(q, k, v),  # noqa: ARG005
        "dnas K=1": lambda q, k, v, w: doubly_normalized_attention(q, k, v),  # noqa: ARG005
        "dnas K=3": lambda q, k, v, w: doubly_normalized_attention(q, k, v, iterations=3),  # noqa: ARG005
        "hnas K=1": lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w),
        "materialized sinkhorn K=1 (peer)": lambda q, k, v, w: materialized_sinkhorn_peer(q, k, v, 1),  # noqa: ARG005
        "materialized sinkhorn K=3 (peer)": lambda q, k, v, w: materialized_sinkhorn_peer(q, k, v, 3),  # noqa: ARG005
    }


def _peer_gb(n: int, iterations: int, backward: bool) -> float:
    """Rough footprint of the materialized peer: live (H, N, N) float32 matrices."""
    mats = (2 * iterations + 3) if backward else 3
    return mats * H * n * n * 4 / 2**30


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def _inputs(n: int, grad: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, H, n, D, generator=g).to(device).requires_grad_(grad) for _ in range(3))
    w = torch.tensor(0.5, device=device, requires_grad=grad)
    return q, k, v, w


def _closure(fn: Callable[..., torch.Tensor], inputs: tuple, backward: bool) -> Callable[[], None]:
    q, k, v, w = inputs

    def run() -> None:
        for t in (q, k, v, w):
            t.grad = None
        if backward:
            fn(q, k, v, w).sum().backward()
        else:
            with torch.no_grad():
                fn(q, k, v, w)

    return run


def memory_factory(impl: str, n: int, backward: bool, device: str = "cpu") -> Callable[[], None]:
    """Inputs for one row, built in the memory subprocess; returns the closure to measure."""
    return _closure(_impls()[impl], _inputs(n, backward, device), backward)


def _sizes(ctx: BenchContext) -> list[int]:
    env = os.environ.get("ATTNOPT_BENCH_DN_SIZES")
    if env:
        return [int(x) for x in env.split(",")]
    return [256, 512] if ctx.quick else [1024, 4096, 8192]


@bench_suite("doubly_normalized")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """DNAS (K=1, 3) and HNAS vs SDPA and the materialized Sinkhorn peer, fwd and fwd+bwd."""
    for n in _sizes(ctx):
        repeat, warmup = (2 if ctx.quick else ctx.repeat, 1) if n <= 1024 else (1, 0)
        for backward in (False, True):
            case = f"N={n} H={H} d={D} {'fwd+bwd' if backward else 'fwd'}"
            inputs = _inputs(n, backward, ctx.device)
            for i, (name, fn) in enumerate(_impls().items()):
                note = "" if repeat > 1 else "single timed run (large N)"
                if "peer" in name:
                    need = _peer_gb(n, 3 if "K=3" in name else 1, backward)
                    if need > PEER_LIMIT_GB or need > 0.7 * _available_gb():
                        yield Measurement("doubly_normalized", case, name, float("nan"), None,
                                          note=f"skipped: needs ~{need:.1f} GB (> {PEER_LIMIT_GB:g} GB "
                                               "limit or 70% of available memory)")
                        continue
                secs = time_call(_closure(fn, inputs, backward), repeat=repeat, warmup=warmup,
                                 device=ctx.device)
                peak = None
                if ctx.memory:
                    args = dict(impl=name, n=n, backward=backward, device=ctx.device)
                    peak = peak_memory_mb("attnopt.bench.doubly_normalized:memory_factory", args,
                                          device=ctx.device)
                yield Measurement("doubly_normalized", case, name, secs, peak, baseline=i == 0, note=note)
