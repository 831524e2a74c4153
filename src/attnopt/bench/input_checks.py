"""Bench rows for the shared entry checks (issue 17): the cost of the non-finite policy.

Every attention op rejects NaN/±inf in ``q``, ``k``, ``v`` with one sum per tensor (an exact
``aminmax`` pass only when a sum of finite values overflows;
:func:`attnopt._validation.check_finite`). Per case (B=1, H=8, d=64, float32, forward): SDPA
(baseline), the check alone, and ``generalized_attention`` (checks + SDPA) end to end, so the
check's share of one attention call reads off the ratio column.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt._validation import check_finite, validate_attention
from attnopt.bench._harness import BenchContext, Measurement, bench_suite, time_call
from attnopt.functional.generalized import generalized_attention

H, D = 8, 64


def _impls() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]]:
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "check_finite(q, k, v)": lambda q, k, v: check_finite(q=q, k=k, v=v),
        "validate_attention (all entry checks)": lambda q, k, v: validate_attention(q, k, v),
        "generalized_attention (checks + SDPA)": lambda q, k, v: generalized_attention(q, k, v),
    }


@bench_suite("input_checks")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """The non-finite/shape entry checks vs one SDPA call, forward, float32."""
    sizes = [16, 256] if ctx.quick else [16, 256, 1024, 4096]
    repeat = 3 if ctx.quick else max(ctx.repeat, 5)
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, H, n, D, generator=g).to(ctx.device) for _ in range(3))
        for i, (name, fn) in enumerate(_impls().items()):

            def run(fn: Callable[..., object] = fn, args: tuple = (q, k, v)) -> None:
                with torch.no_grad():
                    fn(*args)

            secs = time_call(run, repeat=repeat, device=ctx.device)
            yield Measurement("input_checks", f"N={n} fwd float32", name, secs, None, baseline=i == 0)
