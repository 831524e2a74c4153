"""Bench rows for generalized attention (fenchel-dual-attention eq. 16–18) vs SDPA.

* ``mask``: ``generalized_attention`` with an additive float (B,H,N,N) log-preference vs SDPA
  with the same additive mask (baseline) and a naive materialized implementation.
* ``key-only``: a key-only preference (B,H,1,N) vs SDPA without any mask (baseline).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.functional.generalized import generalized_attention

H, D = 8, 64


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) / D**0.5
    if bias is not None:
        s = s + bias
    return torch.softmax(s, dim=-1) @ v


def _impls(kind: str) -> dict[str, Callable[..., torch.Tensor]]:
    if kind == "mask":
        return {
            "sdpa": lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b),
            "generalized_attention": lambda q, k, v, b: generalized_attention(q, k, v, log_preference=b),
            "naive": _naive,
        }
    return {
        "sdpa (no mask)": lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v),  # noqa: ARG005
        "generalized_attention": lambda q, k, v, b: generalized_attention(q, k, v, log_preference=b),
        "naive": _naive,
    }


def _inputs(
    n: int, kind: str, grad: bool, device: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, H, n, D, generator=g).to(device, dtype).requires_grad_(grad) for _ in range(3))
    shape = (1, H, n, n) if kind == "mask" else (1, H, 1, n)
    bias = torch.randn(shape, generator=g).to(device, dtype).contiguous()
    return q, k, v, bias


def _closure(fn: Callable[..., torch.Tensor], inputs: tuple, backward: bool) -> Callable[[], None]:
    q, k, v, b = inputs

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, b)
        if backward:
            out.sum().backward()

    return run


def memory_factory(kind: str, impl: str, n: int, backward: bool, device: str = "cpu") -> Callable[[], None]:
    """Inputs for one row, built in the memory subprocess; returns the closure to measure."""
    return _closure(_impls(kind)[impl], _inputs(n, kind, backward, device), backward)


def _cases(ctx: BenchContext) -> list[int]:
    return [256, 512] if ctx.quick else [512, 2048, 4096]


@bench_suite("generalized")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """generalized_attention vs SDPA (same mask; key-only preference vs no mask), fwd and fwd+bwd."""
    repeat = 2 if ctx.quick else ctx.repeat
    dtypes = [torch.float32] + ([torch.bfloat16] if ctx.device == "cuda" else [])
    for dtype in dtypes:
        for kind in ("mask", "key-only"):
            for n in _cases(ctx):
                for backward in (False, True):
                    case = f"{kind} N={n} {'fwd+bwd' if backward else 'fwd'} {str(dtype)[6:]}"
                    inputs = _inputs(n, kind, backward, ctx.device, dtype)
                    for i, (name, fn) in enumerate(_impls(kind).items()):
                        if name == "naive" and n > 2048 and kind == "key-only":
                            continue
                        secs = time_call(_closure(fn, inputs, backward), repeat=repeat, device=ctx.device)
                        peak = None
                        if ctx.memory and dtype == torch.float32:
                            args = dict(kind=kind, impl=name, n=n, backward=backward, device=ctx.device)
                            peak = peak_memory_mb(
                                "attnopt.bench.generalized:memory_factory", args, device=ctx.device
                            )
                        yield Measurement("generalized", case, name, secs, peak, baseline=i == 0)
