"""Bench rows for training: every registry attention in the same encoder, and the engine's overhead.

* ``train_step``: one optimizer step (forward + backward + AdamW) of a 2-layer pre-LN
  :class:`attnopt.models.TransformerEncoder` (E = 64, H = 4, B = 32) whose attention is each
  registry name in turn, N = 128 and 512 (``--quick``: N = 128); baseline ``softmax``.
  ``mem`` (a Newton solve per forward) is skipped at N = 512 in quick mode.
* ``train_engine``: one epoch of the ``ot-vit`` task's ViT on digits through ``attnopt
  train`` (``run_task``: Lightning fit incl. its per-fit setup, checkpoint, logging) vs a
  bare PyTorch loop over the same model, data order and optimizer (baseline); and OT-ViT's
  training step vs ViT's inside the engine.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, time_call
from attnopt.models import TransformerEncoder, auxiliary_loss
from attnopt.nn import attention_names, attention_spec


def _step_closure(name: str, n: int, device: str) -> tuple[object, object]:
    torch.manual_seed(0)
    model = TransformerEncoder(
        d_model=64,
        num_heads=4,
        num_layers=2,
        attention=name,
        input_dim=16,
        num_outputs=4,
        max_len=max(n, 16),
        dropout=0.0,
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, n, 16, device=device)
    y = torch.randint(0, 4, (32,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y) + 1e-3 * auxiliary_loss(model)
        loss.backward()
        opt.step()

    return step, model


@bench_suite("train_step")
def train_step(ctx: BenchContext) -> Iterator[Measurement]:
    names = [n for n in attention_names() if attention_spec(n).multihead_convention]
    sizes = (128,) if ctx.quick else (128, 512)
    repeat = 2 if ctx.quick else ctx.repeat
    for n in sizes:
        case = f"B=32 N={n} E=64 H=4 L=2 fwd+bwd+AdamW"
        for name in names:
            if name == "mem" and (ctx.quick or n > 128):
                yield Measurement(
                    "train_step", case, name, float("nan"), note="skipped: Newton solve per forward"
                )
                continue
            step, _ = _step_closure(name, n, ctx.device)
            secs = time_call(step, repeat=repeat, warmup=1, device=ctx.device)  # type: ignore[arg-type]
            yield Measurement("train_step", case, name, secs, baseline=name == "softmax")


def _bare_epoch_seconds(epochs: int) -> float:
    """A plain PyTorch loop over the ot-vit task's ViT (same data, order, optimizer)."""
    from torch.utils.data import DataLoader

    from attnopt.experiments import RunConfig, get_task
    from attnopt.experiments._engine import EpochSampler

    task = get_task("ot-vit")
    sc = task.quick
    cfg = RunConfig(
        task="ot-vit",
        arm="vit",
        seed=0,
        lr=3e-3,
        epochs=epochs,
        batch_size=sc.batch_size,
        quick=True,
        dataset="digits",
        sizes=dict(sc.sizes),
    )
    torch.manual_seed(0)
    data = task.build_data(cfg)
    model = task.build_model("vit", cfg, data)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sampler = EpochSampler(len(data.train), seed=0)  # type: ignore[arg-type]
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler)
    gen = torch.Generator()
    t0 = time.perf_counter()  # the loop only: data and model are built outside the engine's clock too
    for e in range(epochs):
        sampler.set_epoch(e)
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            loss = task.training_loss(model, task.train_batch_transform(batch, cfg, gen), cfg)
            loss.backward()
            opt.step()
    return (time.perf_counter() - t0) / epochs


@bench_suite("train_engine")
def train_engine(ctx: BenchContext) -> Iterator[Measurement]:
    from attnopt.experiments._engine import run_task

    epochs = 2 if ctx.quick else 5
    torch.set_num_threads(1)
    rounds = 1 if ctx.quick else 3
    bare, engine, steps = [], [], {"vit": [], "ot-vit": []}  # type: ignore[var-annotated]
    for _ in range(rounds):  # interleaved A/B rounds, min of each
        bare.append(_bare_epoch_seconds(epochs))
        with tempfile.TemporaryDirectory() as tmp:
            recs = run_task(
                "ot-vit",
                arms=["vit", "ot-vit"],
                seeds=[0],
                lrs=[3e-3],
                epochs=epochs,
                quick=True,
                out_dir=tmp,
                progress=False,
                write_report=False,
                threads=1,
            )
        vit = recs[0]
        engine.append((vit["wall_time_s"] - vit["eval_time_s"]) / epochs)
        for r in recs:
            steps[r["arm"]].append(r["step_time_s"])
    case = f"ot-vit task, ViT on digits, {epochs} epochs, 1 thread: seconds per epoch"
    yield Measurement("train_engine", case, "bare PyTorch loop", min(bare), baseline=True)
    yield Measurement(
        "train_engine",
        case,
        "attnopt train (Lightning fit, ckpt, logs)",
        min(engine),
        note="includes Lightning's per-fit setup",
    )
    case2 = "ot-vit task on digits: median training step inside the engine"
    yield Measurement("train_engine", case2, "ViT", min(steps["vit"]), baseline=True)
    yield Measurement("train_engine", case2, "OT-ViT (same-class bank half the time)", min(steps["ot-vit"]))
