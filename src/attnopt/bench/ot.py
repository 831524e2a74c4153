"""Bench rows for OT-based attention (fenchel-dual-attention eq. 22).

Per case (Nq = n = m = N, d = 64, one head, float32, ``cost="neg_dot"``, α = 1, γ = √d):

* ``generalized_attention`` (eq. 16, SDPA-based) — the baseline peer;
* ``ot_attention`` — two stabilized log-domain matmuls, O((Nq + n)·m) memory;
* ``materialized (22)`` — the literal ``Nq × n × m`` form (softmax over the bank for every
  (query, template) pair), skipped when that tensor would not fit (N = 2048: 34 GB).

The ``note`` of the ``ot_attention`` row gives its speed-up over the materialized form. Times
are the minimum over ``repeat`` interleaved rounds (see :func:`_interleaved_min`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.functional.generalized import generalized_attention
from attnopt.functional.ot import ot_attention

D = 64
GAMMA = math.sqrt(D)
MATERIALIZED_MAX_N = 512


def _materialized(z: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Eq. (22) literally: ``q[k,i,a] = softmax_a((z_k·a + a·t_i)/γ)``, ``p = Σ_i u_i q``, ``ĥ = p A``."""
    expo = ((z @ t.transpose(-2, -1)).unsqueeze(-2) + (t @ t.transpose(-2, -1)).unsqueeze(-3)) / GAMMA
    q = torch.softmax(expo, dim=-1)  # (B, H, Nq, n, m)
    p = (u.unsqueeze(-2).unsqueeze(-1) * q).sum(-2)
    return p @ t


def _impls() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {
        "generalized_attention (16)": lambda z, t, u: generalized_attention(
            z, t, t, preference=u.unsqueeze(-2), scale=1.0 / GAMMA
        ),
        "ot_attention": lambda z, t, u: ot_attention(z, t, preference=u, alpha=1.0, gamma=GAMMA),
        "materialized (22)": _materialized,
    }


def _inputs(n: int, grad: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    z = torch.randn(1, 1, n, D, generator=g).to(device).requires_grad_(grad)
    t = torch.randn(1, 1, n, D, generator=g).to(device).requires_grad_(grad)
    u = torch.rand(1, 1, n, generator=g).to(device) + 0.1
    return z, t, u / u.sum(-1, keepdim=True)


def _closure(fn: Callable[..., torch.Tensor], inputs: tuple, backward: bool) -> Callable[[], None]:
    z, t, u = inputs

    def run() -> None:
        z.grad = t.grad = None
        out = fn(z, t, u)
        if backward:
            out.sum().backward()

    return run


def memory_factory(impl: str, n: int, backward: bool, device: str = "cpu") -> Callable[[], None]:
    """Inputs for one row, built in the memory subprocess; returns the closure to measure."""
    return _closure(_impls()[impl], _inputs(n, backward, device), backward)


def _interleaved_min(impls: dict[str, Callable[[], None]], repeat: int, device: str) -> dict[str, float]:
    """Best wall time of each closure over ``repeat`` rounds that run every closure once.

    The machine this was written on is shared: interleaving puts every implementation under
    the same load, and the minimum estimates the uncontended time better than the median.
    """
    best = {name: math.inf for name in impls}
    for run in impls.values():
        time_call(run, repeat=1, warmup=1, device=device)
    for _ in range(repeat):
        for name, run in impls.items():
            best[name] = min(best[name], time_call(run, repeat=1, warmup=0, device=device))
    return best


def _cases(ctx: BenchContext) -> list[int]:
    return [128, 256] if ctx.quick else [128, 512, 2048]


@bench_suite("ot")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """ot_attention vs generalized attention (baseline) and the materialized eq. (22), fwd and fwd+bwd."""
    repeat = 2 if ctx.quick else ctx.repeat
    for n in _cases(ctx):
        for backward in (False, True):
            case = f"N={n} d={D} {'fwd+bwd' if backward else 'fwd'}"
            inputs = _inputs(n, backward, ctx.device)
            impls = {
                name: _closure(fn, inputs, backward)
                for name, fn in _impls().items()
                if not (name.startswith("materialized") and n > MATERIALIZED_MAX_N)
            }
            best = _interleaved_min(impls, repeat, ctx.device)
            rows = []
            for i, name in enumerate(impls):
                secs = best[name]
                peak = None
                if ctx.memory:
                    args = dict(impl=name, n=n, backward=backward, device=ctx.device)
                    peak = peak_memory_mb("attnopt.bench.ot:memory_factory", args, device=ctx.device)
                rows.append(Measurement("ot", case, name, secs, peak, baseline=i == 0))
            by_name = {m.impl: m for m in rows}
            ours, lit = by_name["ot_attention"], by_name.get("materialized (22)")
            if lit is not None:
                ours.note = f"{lit.seconds / ours.seconds:.1f}x faster than materialized"
                if ours.peak_mb and lit.peak_mb:
                    ours.note += f", {lit.peak_mb / ours.peak_mb:.1f}x less memory"
            else:
                ours.note = f"materialized skipped ({n**3 * 4 / 2**30:.0f} GiB tensor)"
            yield from rows
