"""A tiny task for the engine's tests: classify Gaussian blobs of 4 tokens with a 1-layer encoder."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from attnopt.experiments import DataBundle, RunConfig, Scale, Task
from attnopt.models import TransformerEncoder


class TinyTask(Task):
    name = "tiny"
    paper = "none"
    table = "engine test"
    metric = "accuracy"
    arms = {"softmax": {"attention": "softmax"}, "dnas": {"attention": "dnas"}, "ikan": {"attention": "ikan"}}
    default_arms = ("softmax", "dnas")
    lr_grid = (1e-2,)
    datasets = ("blobs",)
    paper_results = {"blobs": {"softmax": 0.9}}
    quick = Scale(epochs=2, seeds=2, batch_size=16, sizes={"n": 96})
    full = Scale(epochs=3, seeds=2, batch_size=16, sizes={"n": 96})

    def build_data(self, cfg: RunConfig) -> DataBundle:
        g = torch.Generator().manual_seed(1234)
        n = int(cfg.size("n", 96))
        y = torch.randint(0, 3, (n,), generator=g)
        centers = torch.randn(3, 4, 3, generator=g) * 2
        x = centers[y] + torch.randn(n, 4, 3, generator=g)
        k = n * 3 // 4
        return DataBundle(
            train=TensorDataset(x[:k], y[:k]), test=TensorDataset(x[k:], y[k:]), info={"n_classes": 3}
        )

    def build_model(self, arm: str, cfg: RunConfig, data: DataBundle) -> nn.Module:
        return TransformerEncoder(
            d_model=8, num_heads=2, num_layers=1, input_dim=3, num_outputs=3, dropout=0.1, **self.arms[arm]
        )

    def training_loss(self, model: nn.Module, batch: Any, cfg: RunConfig) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model, loader, data, cfg) -> dict[str, float]:  # type: ignore[no-untyped-def]
        correct = total = 0
        loss = 0.0
        for x, y in loader:
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            total += len(y)
        return {"accuracy": correct / total, "loss": loss / total}


TASK = TinyTask()

if (
    __name__ == "__main__"
):  # used by the kill/resume and DDP tests: python -m tests.experiments._tiny OUT [args]
    import json

    from attnopt.experiments._engine import run_task

    out = sys.argv[1]
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    run_task(TASK, out_dir=out, progress=False, **opts)
