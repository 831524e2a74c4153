"""Bench rows at the sequence lengths people train at (N = 64–1024), every mechanism beside SDPA.

Cases: B·H ∈ {8, 64} (B = 1 or 8, H = 8), N ∈ {64, 128, 256, 512, 1024}, d = 64, float32,
forward (no grad) and forward+backward; quick mode: B·H = 8, N ∈ {64, 256, 512}.

Rows per case: SDPA (baseline); the materialized log-domain Sinkhorn peer (K = 1 and 3,
autograd through everything); DNAS K = 1, Sinkhorn K = 3, HNAS (w = 0.5, per layer);
sparsemax and 1.5-entmax attention; IKA-S (R = 8) and IKAN (R = 16, p = 1.5) kernel attention
with fixed spectral points, and IKAN / MIKAN (R = 16, p = 1.5) as their modules run them on the
heads (``attend``: points sampled from the density networks in training mode, KL included);
Expsin (the periodic kernel × L2 magnitude of the registry's ``expsin``, its fused node);
generalized attention with a learned T5 relative bias and with ALiBi (bias built by the
preference module inside the timed call) and the SDPA rows computing the same functions —
what a user would write instead: SDPA with the same fixed ALiBi bias as its float mask, and
SDPA with the learned T5 bias as its mask (its math kernel: the mask needs a gradient). The
issue-16 target for generalized attention (≤ 1.2×) is read against those rows (the note
gives the ratio); the ratio to plain SDPA (the row baseline) is printed as for every row.
Mechanisms with two implementations run with ``impl="auto"``; the row's note says which path
``auto`` chose (:data:`attnopt.functional.dispatch.last_dispatch`) and the other path is timed
too (full mode), so each crossover can be checked.

Registry rows (``registry N=…``): every :func:`attnopt.nn.make_attention` name (except the
pooling-only ``ot``; ``mem`` up to N = 256) as a module on ``x (B, N, 512)``, H = 8,
forward+backward, against the ``softmax`` module. Encoder rows (``encoder step N=…``): one
training step (forward, cross-entropy, backward, Adam step) of a 2-layer
:class:`attnopt.models.TransformerEncoder` (E = 512, H = 8, B = 8) with each attention,
against the ``softmax`` arm.

Timing (CPU): torch limited to one thread, best of ``repeat`` in *thread CPU time* after a
warm-up — on a shared, loaded 2-core machine wall-clock medians swing by several × while CPU
time measures the work; the wall time of the same best run is in the note. The function rows
of a case are timed in interleaved rounds (:func:`_interleaved`: every row once per round), so
a slow spell of the machine costs each row one round rather than every round of the rows that
ran during it. CUDA: harness
wall time. Before the first timed row of each section, one untimed round runs every row
(:func:`_warm_up`): the first rows (the baselines) no longer pay the process's first-call costs
(lazy imports, C libraries loaded, the allocator's first growth), which read the N = 64 SDPA
baseline 0.68 ms once where it takes 0.41.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnopt import _native
from attnopt.bench._harness import BenchContext, Measurement, bench_suite, time_call
from attnopt.bench.doubly_normalized import materialized_sinkhorn_peer
from attnopt.functional import dispatch, generalized
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention
from attnopt.functional.generalized import generalized_attention
from attnopt.functional.kernel import kernel_attention
from attnopt.functional.regularized import regularized_attention
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from attnopt.kernels import NonStationaryFourier, Periodic, RandomFourier
from attnopt.nn.implicit_kernel import ImplicitKernelAttention
from attnopt.nn.preference import ALiBiPreference, T5RelativePreference

SUITE = "small_n"
H, D = 8, 64
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# row name -> its key in dispatch.CROSSOVERS
DISPATCHED = {"dnas K=1": "doubly_normalized", "sinkhorn K=3": "sinkhorn", "hnas K=1": "hybrid_normalized",
              "sparsemax": "sparse", "entmax-1.5": "sparse", "generalized ALiBi": "generalized",
              "generalized T5 (learned bias)": "generalized"}


def _impls(device: str, impl: dispatch.Impl) -> dict[str, Fn]:
    g = torch.Generator().manual_seed(0)
    rff8 = RandomFourier(RandomFourier.rbf(8, D, generator=g).spectral_points.to(device))
    nsf = NonStationaryFourier.gaussian(16, D, D**-0.25 / 2**0.5, 0.5 * D**-0.25, generator=g)
    nsf16 = NonStationaryFourier(nsf.w1.to(device), nsf.w2.to(device))
    t5 = T5RelativePreference(H).to(device)
    alibi = ALiBiPreference(H).to(device)
    periodic = Periodic(2 * math.pi)
    w = torch.tensor(0.5, device=device, requires_grad=True)
    sm, e15 = SquaredL2(), Tsallis(1.5)
    sampled = {v: ImplicitKernelAttention(H * D, H, v, num_samples=16, p=1.5, seed=0).to(device)
               for v in ("ikan", "mikan")}
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "materialized sinkhorn K=1 (peer)": lambda q, k, v: materialized_sinkhorn_peer(q, k, v, 1),
        "materialized sinkhorn K=3 (peer)": lambda q, k, v: materialized_sinkhorn_peer(q, k, v, 3),
        "dnas K=1": lambda q, k, v: doubly_normalized_attention(q, k, v, impl=impl),
        "sinkhorn K=3": lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=3, impl=impl),
        "hnas K=1": lambda q, k, v: hybrid_normalized_attention(q, k, v, w, impl=impl),
        "sparsemax": lambda q, k, v: regularized_attention(q, k, v, regularizer=sm, impl=impl),
        "entmax-1.5": lambda q, k, v: regularized_attention(q, k, v, regularizer=e15, impl=impl),
        "ika-s R=8": lambda q, k, v: kernel_attention(q, k, v, kernel=rff8),
        "ikan R=16 p=1.5": lambda q, k, v: kernel_attention(q, k, v, kernel=nsf16, magnitude_p=1.5),
        "ikan R=16 sampled (module core)": _sampled(sampled["ikan"]),
        "mikan R=16 sampled (module core)": _sampled(sampled["mikan"]),
        "expsin (periodic P=2pi)": lambda q, k, v: kernel_attention(q, k, v, kernel=periodic),
        "generalized T5 (learned bias)": lambda q, k, v: generalized_attention(
            q, k, v, log_preference=t5(q.shape[-2], k.shape[-2]), impl=impl),
        "generalized ALiBi": lambda q, k, v: generalized_attention(
            q, k, v, log_preference=alibi(q.shape[-2], k.shape[-2]), impl=impl),
    }


def _sampled(mod: ImplicitKernelAttention) -> Fn:
    """The module's attention on (B, H, N, d) heads: spectral sampling (training noise), KL, attention.

    The module's parameter gradients are reset before each call, as ``q``, ``k``, ``v``'s are (a
    training step's ``zero_grad(set_to_none=True)``): gradients accumulated over thousands of
    timed calls would add an ``add_`` per parameter that no training step runs. Returns the
    scalar ``O.sum() + 0·KL`` (the caller's ``.sum()`` of it is the identity), as a training
    loss adds the KL to the task's scalar loss.
    """
    params = list(mod.parameters())

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for p in params:
            p.grad = None
        out, _ = mod.attend(q, k, v, None, False, False)
        # a training loss: the task's scalar plus the KL term (weight 0 here: its backward runs)
        return torch.add(out.sum(), mod.kl(), alpha=0.0)

    return run


def _with_bias(bias: torch.Tensor) -> Fn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return run


def _with_t5(device: str) -> Fn:
    t5 = T5RelativePreference(H).to(device)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=t5(q.shape[-2], k.shape[-2]))

    return run


#: generalized row -> the SDPA row computing the same function (what a user would write instead)
SAME_FUNCTION = {"generalized ALiBi": "sdpa + same ALiBi bias (scale)",
                 "generalized T5 (learned bias)": "sdpa + same T5 bias (learned)"}


def _closure(fn: Fn, qkv: tuple[torch.Tensor, ...], backward: bool) -> Callable[[], None]:
    def run() -> None:
        if backward:
            for t in qkv:
                t.grad = None
            fn(*qkv).sum().backward()
        else:
            with torch.no_grad():
                fn(*qkv)

    return run


def _best(fn: Callable[[], None], repeat: int, device: str) -> tuple[float, float]:
    """(best thread CPU seconds, wall seconds of that run); CUDA: (median wall, same)."""
    if device.startswith("cuda"):
        t = time_call(fn, repeat=repeat, device=device)
        return t, t
    fn()
    best, wall = float("inf"), float("nan")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        c, w = time.thread_time() - c0, time.perf_counter() - w0
        if c < best:
            best, wall = c, w
    return best, wall


#: untimed calls of each function row in the warm-up round (each row's own untimed call stays)
WARMUP_CALLS = 3


def _warm_up(runs: Iterator[Callable[[], None]], calls: int) -> None:
    """Run every closure ``calls`` times, untimed (see the module docstring)."""
    for run in runs:
        for _ in range(calls):
            run()


def _cases(ctx: BenchContext) -> list[tuple[int, int]]:
    if ctx.quick:
        return [(1, n) for n in (64, 256, 512)]
    return [(b, n) for b in (1, 8) for n in (64, 128, 256, 512, 1024)]


def _registry_runs(ctx: BenchContext, n: int) -> Iterator[tuple[str, Callable[[], None]]]:
    """``(name, fwd+bwd closure)`` of every registry module on ``x (1, n, H·D)``."""
    from attnopt.nn.registry import attention_names, make_attention

    torch.manual_seed(0)
    x = torch.randn(1, n, H * D, device=ctx.device, requires_grad=True)
    for name in attention_names():
        if name == "ot" or (name == "mem" and n > 256):
            continue
        mod = make_attention(name, H * D, H).to(ctx.device)

        def run(mod: torch.nn.Module = mod) -> None:
            x.grad = None
            mod(x)[0].sum().backward()

        yield name, run


def _registry_rows(ctx: BenchContext, n: int, repeat: int) -> Iterator[Measurement]:
    for name, run in _registry_runs(ctx, n):
        cpu, wall = _best(run, repeat, ctx.device)
        path = ",".join(f"{k}={v}" for k, v in sorted(dispatch.last_dispatch.items()))
        yield Measurement(SUITE, f"registry N={n} B*H={H} fwd+bwd", name, cpu, baseline=name == "softmax",
                          note=f"wall {wall * 1e3:.2f} ms; last_dispatch {path}")


def _encoder_runs(
    ctx: BenchContext, n: int, batch: int = 8, head_dim: int | None = None
) -> Iterator[tuple[str, Callable[[], None]]]:
    """``(name, training-step closure)`` of a 2-layer encoder (E = H·head_dim) per attention."""
    from attnopt.models import TransformerEncoder
    from attnopt.nn.registry import attention_names

    e = H * (D if head_dim is None else head_dim)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(batch, n, 32, generator=g).to(ctx.device)
    y = torch.randint(0, 10, (batch,), generator=g).to(ctx.device)
    for name in attention_names():
        if name in ("ot", "mem"):
            continue
        torch.manual_seed(0)
        model = TransformerEncoder(d_model=e, num_heads=H, num_layers=2, attention=name, input_dim=32,
                                   num_outputs=10, max_len=n + 1, dropout=0.0).to(ctx.device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        yield name, step


def _encoder_rows(ctx: BenchContext, n: int, repeat: int) -> Iterator[Measurement]:
    for name, step in _encoder_runs(ctx, n):
        cpu, wall = _best(step, repeat, ctx.device)
        yield Measurement(SUITE, f"encoder step N={n} B=8 E={H * D} L=2", name, cpu,
                          baseline=name == "softmax", note=f"wall {wall * 1e3:.2f} ms")


@bench_suite(SUITE)
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """Every mechanism vs SDPA at N = 64–1024, fwd and fwd+bwd, with the crossover chosen."""
    threads = torch.get_num_threads()
    if not ctx.device.startswith("cuda"):
        torch.set_num_threads(1)
    try:
        yield from _rows(ctx)
    finally:
        torch.set_num_threads(threads)


def _rows(ctx: BenchContext) -> Iterator[Measurement]:
    yield from _function_rows(ctx)
    sizes = sorted({n for _, n in _cases(ctx)})
    # warm-up rounds (module docstring): the registry modules at the first size, two calls each
    # (~0.4 s); the encoder arms as small models (E = H·4, B = 2, N = 16; one step each, ~0.5 s):
    # building every full-size model once more would cost ~6 s of the quick run's ~65
    _warm_up((run for _, run in _registry_runs(ctx, sizes[0])), 2)
    for n in sizes:
        yield from _registry_rows(ctx, n, 2 if ctx.quick else ctx.repeat)
    _warm_up((step for _, step in _encoder_runs(ctx, 16, batch=2, head_dim=4)), 1)
    for n in [m for m in sizes if m <= 256]:
        yield from _encoder_rows(ctx, n, 2 if ctx.quick else ctx.repeat)


def _case_rows(
    ctx: BenchContext, auto: dict[str, Fn], b: int, n: int, backward: bool
) -> tuple[tuple[torch.Tensor, ...], dict[str, Fn]]:
    """The inputs ``q, k, v (b, H, n, D)`` of a case and its rows (name -> function)."""
    g = torch.Generator().manual_seed(n)
    qkv = tuple(torch.randn(b, H, n, D, generator=g).to(ctx.device).requires_grad_(backward)
                for _ in range(3))
    bias = ALiBiPreference(H).to(ctx.device)(n, n).detach().contiguous()
    rows: dict[str, Fn] = dict(auto)
    rows["sdpa + same ALiBi bias (scale)"] = _with_bias(bias)
    rows["sdpa + same T5 bias (learned)"] = _with_t5(ctx.device)
    if b * H * n * n > 1 << 23:
        rows = {name: fn for name, fn in rows.items() if "K=3 (peer)" not in name}
    return qkv, rows


def _interleaved(
    runs: dict[str, Callable[[], None]], repeat: int, device: str
) -> dict[str, tuple[float, float]]:
    """``name -> (best thread CPU seconds, wall seconds of that run)`` over ``repeat`` rounds, each
    round one timed call of every row in turn (CUDA: :func:`_best` per row). A slow spell of the
    machine then costs every row one round, instead of all the rounds of the rows that ran in it
    (a baseline read 0.70 ms where it takes 0.42, and every ratio of its case with it)."""
    if device.startswith("cuda"):
        return {name: _best(run, repeat, device) for name, run in runs.items()}
    best = {name: (float("inf"), float("nan")) for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            run()
            c, w = time.thread_time() - c0, time.perf_counter() - w0
            if c < best[name][0]:
                best[name] = (c, w)
    return best


def _rule(name: str, key: str, qkv: tuple[torch.Tensor, ...]) -> str:
    """The dispatch rule behind a row's ``auto`` choice, for its note."""
    limit = dispatch.CROSSOVERS[key]["float32"]
    rule = "a learned bias: always" if "learned" in name else f"crossover B*H*N^2 <= {limit}"
    if key != "generalized":
        return rule
    native = generalized.cpu.library(*qkv) is not None
    t = THRESHOLDS
    if native and "learned" not in name:
        rule += (f" (C passes, Nq*Nk >= {t.generalized_native_min_head_scores}: "
                 f"<= {t.generalized_native_crossover})")
    below = (t.generalized_sdpa_below_learned_native if "learned" in name and native
             else t.generalized_sdpa_below)
    rule = f"SDPA itself at B*H*N^2 <= {below}; above, {rule}"
    if native and _native.blas() is not None:  # T5 / ALiBi: the whole-call C path first
        kernel = dispatch.last_dispatch.get("generalized_kernel", "?")
        rule = (f"kernel {kernel}; whole-call C path under autograd at B*H*N^2 <= "
                f"{t.generalized_wholecall_below}, Nq*Nk <= {t.generalized_wholecall_max_head_scores}; "
                f"else {rule}")
    return rule


def _function_rows(ctx: BenchContext) -> Iterator[Measurement]:
    auto = _impls(ctx.device, "auto")
    cases = _cases(ctx)
    for backward in (False, True):  # the warm-up round: every row of the first case, untimed
        qkv, rows = _case_rows(ctx, auto, *cases[0], backward)
        _warm_up((_closure(fn, qkv, backward) for fn in rows.values()), WARMUP_CALLS)
    for b, n in cases:
        size = b * H * n * n
        # tiny cases cost ~1 ms a call: quick mode keeps enough repeats there that the minimum is
        # not one cold run (2 repeats swung N = 64 ratios by up to 2x on a quiet machine)
        repeat = (max(ctx.repeat, 10) if size <= 1 << 18 else 2) if ctx.quick else (
            ctx.repeat if size <= 1 << 22 else 2)
        for backward in (False, True):
            case = f"B*H={b * H} N={n} d={D} {'fwd+bwd' if backward else 'fwd'}"
            qkv, rows = _case_rows(ctx, auto, b, n, backward)
            runs = {name: _closure(fn, qkv, backward) for name, fn in rows.items()}
            notes: dict[str, str] = {}
            forced: list[str] = []  # rows of the path auto did not choose (full mode)
            for name in rows:
                runs[name]()  # each row's untimed first call; ``auto``'s choice is read right after it
                key = DISPATCHED.get(name)
                if key is None:
                    continue
                path = dispatch.last_dispatch.get(key, "?")
                notes[name] = f"auto -> {path} ({_rule(name, key, qkv)})"
                if not ctx.quick:
                    other: dispatch.Impl = "streaming" if path == "materialized" else "materialized"
                    if other == "streaming" or size <= 1 << 24:
                        runs[f"{name} [{other}]"] = _closure(_impls(ctx.device, other)[name], qkv, backward)
                        forced.append(f"{name} [{other}]")
            best = _interleaved(runs, repeat, ctx.device)
            done: dict[str, Measurement] = {}
            for name in rows:
                cpu, wall = best[name]
                note = f"wall {wall * 1e3:.2f} ms"
                if name in notes:
                    note = f"{notes[name]}; {note}"
                done[name] = Measurement(SUITE, case, name, cpu, baseline=name == "sdpa", note=note)
            for alt in forced:
                cpu, wall = best[alt]
                yield Measurement(SUITE, case, alt, cpu, note=f"forced; wall {wall * 1e3:.2f} ms")
            for name, m in done.items():
                peer = done.get(SAME_FUNCTION.get(name, ""))
                if peer is not None:
                    m.note = f"{m.note}; {m.seconds / peer.seconds:.2f}x the same-function SDPA row"
                yield m
