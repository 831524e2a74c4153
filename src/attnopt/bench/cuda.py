"""Bench rows of the GPU backend (issue 31): the Triton kernels / FlexAttention route vs SDPA flash.

``attnopt bench --device cuda --only cuda`` (``scripts/gpu_check.sh`` runs it). Every case is
B·H = 32 (B = 4, H = 8), d = 64, bf16, forward+backward, N = 4096 and 16384 (``--quick``: 1024,
4096; ``ATTNOPT_BENCH_CUDA_SIZES=…`` overrides). Baseline: SDPA with the flash backend. Rows:

* ``dnas K=1`` (target ≤ 1.6× SDPA flash), ``hnas K=1`` (≤ 1.8×): ``attnopt.backend("triton")``;
  peer: the materialized log-domain Sinkhorn (sinkformers style) where it fits (N ≤ 4096);
* ``entmax-1.5`` (target ≤ 1.2× SDPA flash at N ≥ 4k and not slower than ``adasplash``): peers
  ``adasplash`` (if installed) and the ``entmax`` package on materialized scores (N ≤ 4096);
* ``t5 causal`` / ``alibi causal`` through FlexAttention (target ≤ 1.3× SDPA flash); peer: SDPA
  with the materialized bias (N ≤ 4096). The bias is built once outside the timed call (the
  preference modules lay out a ``(1, H, N, N)`` tensor; the Flex route reads only its offsets);
* implicit-kernel attention (no targets; IKA vs SDPA flash): ``ikan R=32 p=1`` (stationary points
  per head) and ``mikan R=32 p=1.5`` (non-stationary stacked points, MIKAN's layout): features,
  magnitude and attention in the fused Triton pass; ``ikan linear causal R=16 p=1``: the causal
  linear mode as a chunked scan (O(N·R²·dv), one program per head), baseline SDPA flash causal.

Plain FlexAttention (no ``score_mod``) is shown for scale in every case. Memory (``peak MB``):
``torch.cuda.max_memory_allocated`` around one call in this process (a fresh subprocess per row
would recompile every Triton / Flex kernel, tens of seconds each, beyond the script's 8-minute
budget). On a CPU with ``ATTNOPT_BENCH_CUDA_SIZES`` set the suite runs forward-only rows in
Triton's interpreter (float32, B·H = 2): a check of the suite's logic, not a measurement.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, time_call

BATCH, H, D = 4, 8, 64
SIZES, QUICK_SIZES = [4096, 16384], [1024, 4096]
PEER_MAX_N = 4096  # materialized peers: (B·H, N, N) float32 matrices, ~2 GiB each at 4096
TARGETS = {"dnas K=1": 1.6, "hnas K=1": 1.8, "entmax-1.5": 1.2, "t5 causal": 1.3, "alibi causal": 1.3}

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sizes(ctx: BenchContext) -> list[int]:
    env = os.environ.get("ATTNOPT_BENCH_CUDA_SIZES")
    if env:
        return [int(x) for x in env.split(",")]
    return QUICK_SIZES if ctx.quick else SIZES


def _sdpa_flash(causal: bool) -> Fn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _flex_plain() -> Fn:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v)


def _sdpa_bias(bias: torch.Tensor) -> Fn:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _triton(fn: Fn) -> Fn:
    import attnopt

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with attnopt.backend("triton"):
            return fn(q, k, v)
    return run


def _cases(n: int, heads: int, device: str, dtype: torch.dtype) -> dict[str, tuple[bool, dict[str, Fn]]]:
    """case -> (causal, {impl: fn}); our row is named ``attnopt (triton)``."""
    from attnopt.bench.doubly_normalized import materialized_sinkhorn_peer
    from attnopt.functional import (
        Tsallis,
        doubly_normalized_attention,
        generalized_attention,
        hybrid_normalized_attention,
        kernel_attention,
        regularized_attention,
    )
    from attnopt.kernels import NonStationaryFourier, RandomFourier
    from attnopt.nn import ALiBiPreference, T5RelativePreference

    small = n <= PEER_MAX_N
    w = torch.tensor(0.5, device=device)
    t5 = T5RelativePreference(heads).to(device)
    t5_bias = t5(n, n)
    alibi_bias = ALiBiPreference(heads).to(device)(n, n)
    points = torch.randn(heads, 32, D, generator=torch.Generator().manual_seed(0)).to(device) / 8
    kern = RandomFourier(points)
    g = torch.Generator().manual_seed(1)
    kern_ns = NonStationaryFourier.stacked((torch.randn(heads, 64, D, generator=g) / 8).to(device))
    kern_lin = RandomFourier((torch.randn(heads, 16, D, generator=g) / 8).to(device))
    cases: dict[str, tuple[bool, dict[str, Fn]]] = {
        "dnas K=1": (False, {"attnopt (triton)": _triton(
            lambda q, k, v: doubly_normalized_attention(q, k, v))}),
        "hnas K=1": (False, {"attnopt (triton)": _triton(
            lambda q, k, v: hybrid_normalized_attention(q, k, v, w))}),
        "entmax-1.5": (False, {"attnopt (triton)": _triton(
            lambda q, k, v: regularized_attention(q, k, v, regularizer=Tsallis(1.5)))}),
        "t5 causal": (True, {"attnopt (flex)": _triton(
            lambda q, k, v: generalized_attention(q, k, v, log_preference=t5_bias, is_causal=True))}),
        "alibi causal": (True, {"attnopt (flex)": _triton(
            lambda q, k, v: generalized_attention(q, k, v, log_preference=alibi_bias, is_causal=True))}),
        "ikan R=32 p=1": (False, {"attnopt (triton)": _triton(
            lambda q, k, v: kernel_attention(q, k, v, kernel=kern, magnitude_p=1.0))}),
        "mikan R=32 p=1.5": (False, {"attnopt (triton)": _triton(
            lambda q, k, v: kernel_attention(q, k, v, kernel=kern_ns, magnitude_p=1.5))}),
        "ikan linear causal R=16 p=1": (True, {"attnopt (triton scan)": _triton(
            lambda q, k, v: kernel_attention(q, k, v, kernel=kern_lin, magnitude_p=1.0, mode="linear",
                                             is_causal=True))}),
    }
    if small:
        cases["dnas K=1"][1]["materialized sinkhorn (peer)"] = (
            lambda q, k, v: materialized_sinkhorn_peer(q.float(), k.float(), v.float(), 1))
        causal_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        for name, bias in (("t5 causal", t5_bias), ("alibi causal", alibi_bias)):
            cases[name][1]["sdpa + materialized bias (peer)"] = _sdpa_bias(
                bias.detach().masked_fill(~causal_mask, float("-inf")).to(dtype))
    if importlib.util.find_spec("adasplash") is not None and device == "cuda":
        from adasplash import adasplash

        cases["entmax-1.5"][1]["adasplash (peer)"] = (
            lambda q, k, v: adasplash(q, k, v, alpha=1.5, is_causal=False))
    if small and importlib.util.find_spec("entmax") is not None:
        from entmax import entmax15

        cases["entmax-1.5"][1]["entmax package, materialized (peer)"] = (
            lambda q, k, v: entmax15(q.float() @ k.float().transpose(-2, -1) * D**-0.5, dim=-1) @ v.float())
    return cases


def _closure(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> Callable[[], None]:
    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        if backward:
            fn(q, k, v).float().sum().backward()
        else:
            with torch.no_grad():
                fn(q, k, v)
    return run


def _peak_mb(run: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@bench_suite("cuda")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """The GPU backend vs SDPA flash and the peers (see the module docstring); nothing on a CPU
    unless ``ATTNOPT_BENCH_CUDA_SIZES`` asks for the interpreter's logic check."""
    cuda = ctx.device.startswith("cuda")
    if not cuda and not os.environ.get("ATTNOPT_BENCH_CUDA_SIZES"):
        return
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, heads = (BATCH, H) if cuda else (1, 2)
    backward = cuda  # eager FlexAttention has no CPU backward
    repeat, warmup = (max(1, min(ctx.repeat, 3)), 2) if cuda else (1, 0)
    for n in _sizes(ctx):
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(batch, heads, n, D, generator=g).to(ctx.device, dtype).requires_grad_(backward)
                   for _ in range(3))
        for name, (causal, ours) in _cases(n, heads, ctx.device, dtype).items():
            impls: dict[str, Fn] = {"sdpa flash": _sdpa_flash(causal), **ours}
            if cuda:
                impls["flex, no score_mod (scale)"] = _flex_plain()
            mode = "fwd+bwd" if backward else "fwd"
            case = f"{name} N={n} B*H={batch * heads} d={D} {str(dtype)[6:]} {mode}"
            target = TARGETS.get(name)
            for i, (impl, fn) in enumerate(impls.items()):
                run = _closure(fn, q, k, v, backward)
                try:
                    secs = time_call(run, repeat=repeat, warmup=warmup, device=ctx.device)
                    peak = _peak_mb(run) if cuda and ctx.memory else None
                    with_target = target is not None and impl.startswith("attnopt")
                    note = f"target <= {target:g}x sdpa flash" if with_target else ""
                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # a peer that does not fit
                    secs, peak, note = float("nan"), None, f"failed: {type(exc).__name__}: {str(exc)[:80]}"
                yield Measurement("cuda", case, impl, secs, peak, baseline=i == 0, note=note)
