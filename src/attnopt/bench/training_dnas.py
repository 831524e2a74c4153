"""Bench rows: one training step of the same Transformer encoder with LNAS, DNAS or HNAS attention.

doubly-normalized-attention's trained systems (issue target): a DNAS/HNAS training step
should cost at most 1.5× the LNAS step on the same model, thanks to the O(N) kernels. Each
case times forward + backward + an Adam step of :class:`attnopt.models.TransformerEncoder`
(token input, 2 pre-LN layers, d_model = 64, 4 heads, batch 8, CPU float32) whose attention
is ``make_attention("lnas" | "dnas" | "hnas")``; LNAS is the row's baseline. The process CPU
time per step is in ``extra["cpu_s"]`` (the machine may be shared: compare CPU time too).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import torch

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, time_call

ARMS = ("lnas", "dnas", "hnas")
D_MODEL, HEADS, LAYERS, BATCH, VOCAB = 64, 4, 2, 8, 1000


def train_step(arm: str, n: int, device: str = "cpu") -> Callable[[], None]:
    """A closure running one optimizer step of the ``arm`` encoder on a fixed batch of length ``n``."""
    from attnopt.models import TransformerEncoder

    torch.manual_seed(0)
    model = TransformerEncoder(d_model=D_MODEL, num_heads=HEADS, num_layers=LAYERS, attention=arm,
                               vocab_size=VOCAB, max_len=n, num_outputs=2, pooling="mean", dropout=0.0)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, VOCAB, (BATCH, n), generator=g).to(device)
    y = torch.randint(0, 2, (BATCH,), generator=g).to(device)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def _sizes(ctx: BenchContext) -> list[int]:
    env = os.environ.get("ATTNOPT_BENCH_TRAIN_DN_SIZES")
    if env:
        return [int(x) for x in env.split(",")]
    return [128] if ctx.quick else [128, 512, 2048]


@bench_suite("training_dnas")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """Training-step time of the LNAS / DNAS / HNAS encoder (target: DNAS, HNAS <= 1.5x LNAS)."""
    for n in _sizes(ctx):
        case = f"train step N={n} B={BATCH} d={D_MODEL} H={HEADS} L={LAYERS}"
        repeat = 3 if ctx.quick else ctx.repeat
        steps = {arm: train_step(arm, n, ctx.device) for arm in ARMS}
        wall = {arm: float("inf") for arm in ARMS}
        cpu = {arm: float("inf") for arm in ARMS}
        for arm in ARMS:
            steps[arm]()  # warm-up
        for _ in range(repeat):  # interleaved rounds, min of each (robust on a loaded machine)
            for arm in ARMS:
                c0 = time.process_time()
                wall[arm] = min(wall[arm], time_call(steps[arm], repeat=1, warmup=0, device=ctx.device))
                cpu[arm] = min(cpu[arm], time.process_time() - c0)
        for i, arm in enumerate(ARMS):
            note = "" if i == 0 else f"target <= 1.5x lnas; cpu ratio {cpu[arm] / cpu['lnas']:.2f}"
            yield Measurement("training_dnas", case, arm, wall[arm], None, baseline=i == 0, note=note,
                              extra={"cpu_s": cpu[arm]})
