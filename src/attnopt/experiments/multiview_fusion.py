"""Multi-view fusion, doubly-normalized-attention Sec. 7.1: Table 1, Fig. 3 (and Fig. 1 during training).

The paper fuses the region features of three object detectors with ONE attention layer: the
primary detector's features are the queries, the two secondary detectors' features give keys
and values, and the fused features (one per primary region) feed the classifier. Arms = the
rows of Table 1: the primary view alone, the three views concatenated, and attention fusion
with LNAS, DNAS or HNAS (Sec. 6; its learned mixing weight is Fig. 3).

Offline data (default ``digits``): three region-feature extractors of scikit-learn's 8×8
digits (:mod:`attnopt.experiments._data.digits_views`: raw 2×2 patches = primary; blurred
4×4 windows and Sobel strips = secondary), each seeing an independently occluded copy of the
digit, so the views are partly redundant and partly complementary. Fixed stratified split
(70 % train / 30 % test, ``random_state=0``). ``--data-dir`` with dataset ``npz`` reads
``multiview_features.npz`` (the paper's detector features exported as arrays ``primary``
(N, R0, D0), ``secondary1`` (N, R1, D1), ``secondary2`` (N, R2, D2), ``label`` (N,), ``is_test`` (N,)).

The classifier after fusion (the stand-in for the paper's Pythia backbone) is the same for
every arm: layer norm, the region features side by side (flattened), a one-hidden-layer MLP.
Per epoch the task logs the fusion layer's explaining-away statistics (minimum column mass,
fraction of keys below 1/(10·Nk), on a fixed 512-example training subset) and the HNAS weight.

Runtime (full mode, 5 arms × 5 seeds × 40 epochs × 20 steps): ≈ 4.5 CPU-minutes (4–12 ms per
step, one torch thread). Measured on this 2-core machine while other jobs loaded it (load
average 8–14), one torch thread, median of 10 training steps, evaluation timed on its first
batches and scaled; the full-mode time is extrapolated (steps per epoch × epochs × seeds ×
arms), not a completed run. CPU time at one thread is what a quiet machine needs in wall time
(``attnopt train ... --threads 1``); under that load the wall time was 5–7× larger.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Subset, TensorDataset

from attnopt.experiments._data.cache import cached
from attnopt.experiments._diagnostics import column_mass_over, hnas_weights
from attnopt.experiments._task import DataBundle, RunConfig, Scale, Task, dataset_len
from attnopt.nn.registry import make_attention

__all__ = ["FusionClassifier", "MultiviewFusionTask", "TASK"]

# Table 1 (VQA v2.0 test-dev accuracy, %); the paper reports HNAS only through Fig. 3
PAPER_TABLE1 = {"single-view": 68.33, "concat": 68.79, "lnas": 69.14, "dnas": 69.70}
# Table 1's test-std column (the single-detector baseline has none)
PAPER_TABLE1_STD = {"concat": 69.22, "lnas": 69.50, "dnas": 70.01}
NPZ_FILE = "multiview_features.npz"


class FusionClassifier(nn.Module):
    """Primary-view queries attend to secondary-view keys/values (one layer), then a classifier.

    Args:
        view_dims: feature size of the primary and the two secondary views.
        regions: number of regions of each view.
        fusion: ``None`` (primary only), ``"concat"`` (all regions side by side) or a registry
            attention name (``lnas``/``dnas``/``hnas``) for the fusion layer.
        d_model, num_heads, num_classes: sizes.
    Shapes:
        ``forward(primary (B, R0, D0), sec1 (B, R1, D1), sec2 (B, R2, D2)) -> logits (B, C)``.
    """

    def __init__(self, view_dims: tuple[int, int, int], regions: tuple[int, int, int], *, fusion: str | None,
                 d_model: int, num_heads: int, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.fusion = fusion
        self.proj = nn.ModuleList(nn.Linear(d, d_model) for d in view_dims)
        self.view_embed = nn.Parameter(torch.zeros(3, d_model))
        self.attention = (make_attention(fusion, d_model, num_heads)
                          if fusion not in (None, "concat") else None)
        self.norm_q = nn.LayerNorm(d_model)
        self.norm_kv = nn.LayerNorm(d_model)
        n_regions = sum(regions) if fusion == "concat" else regions[0]
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(n_regions * d_model, 4 * d_model), nn.GELU(),
                                  nn.Linear(4 * d_model, num_classes))

    def fused(self, primary: Tensor, sec1: Tensor, sec2: Tensor) -> Tensor:
        """(B, R, d_model) region features that enter the classifier."""
        views = [p(x) + e for p, x, e in zip(self.proj, (primary, sec1, sec2), self.view_embed)]
        if self.fusion is None:
            return views[0]
        if self.fusion == "concat":
            return torch.cat(views, dim=1)
        assert self.attention is not None
        kv = self.norm_kv(torch.cat(views[1:], dim=1))
        out, _ = self.attention(self.norm_q(views[0]), kv, kv)
        return views[0] + out

    def forward(self, primary: Tensor, sec1: Tensor, sec2: Tensor) -> Tensor:
        return self.head(self.fused(primary, sec1, sec2))


def _digits_tensors() -> dict[str, Tensor]:
    from sklearn.model_selection import train_test_split

    from attnopt.experiments._data.digits_views import digits_views

    v = digits_views(seed=0)
    idx = torch.arange(len(v["label"]))
    _, test_idx = train_test_split(idx.numpy(), test_size=0.3, random_state=0, stratify=v["label"].numpy())
    is_test = torch.zeros(len(idx), dtype=torch.bool)
    is_test[torch.from_numpy(test_idx)] = True
    return {"primary": v["patch"], "secondary1": v["blur"], "secondary2": v["edges"], "label": v["label"],
            "is_test": is_test}


def _npz_tensors(data_dir: Path | None) -> dict[str, Tensor]:
    import numpy as np

    path = Path(data_dir or ".") / NPZ_FILE
    if not path.is_file():
        raise FileNotFoundError(f"dataset 'npz' needs {path} with arrays primary, secondary1, secondary2, "
                                "label, is_test (see attnopt.experiments.multiview_fusion)")
    keys = ("primary", "secondary1", "secondary2", "label", "is_test")
    with np.load(path) as z:
        return {k: torch.from_numpy(z[k]) for k in keys}


class MultiviewFusionTask(Task):
    """Table 1 / Fig. 3: fusing three region-feature views with one LNAS/DNAS/HNAS attention layer."""

    name = "multiview-fusion"
    paper = "doubly-normalized-attention"
    table = "Table 1, Fig. 3 (HNAS weight), Fig. 1 (column mass during training)"
    metric = "accuracy"
    metric_unit = "%"
    arms = {"single-view": {"fusion": None}, "concat": {"fusion": "concat"}, "lnas": {"fusion": "lnas"},
            "dnas": {"fusion": "dnas"}, "hnas": {"fusion": "hnas"}}
    default_arms = ("single-view", "concat", "lnas", "dnas", "hnas")
    lr_grid = (3e-3,)
    datasets = ("digits", "npz")
    paper_results = {"digits": PAPER_TABLE1, "npz": PAPER_TABLE1}
    quick = Scale(epochs=6, seeds=3, batch_size=64, sizes={"d_model": 32, "num_heads": 2})
    full = Scale(epochs=40, seeds=5, batch_size=64, sizes={"d_model": 64, "num_heads": 4})
    extra_sizes = {"hnas_lr": float}  # the HNAS mixing logits' own learning rate (claims set it)

    def build_data(self, cfg: RunConfig) -> DataBundle:
        dataset = cfg.dataset or self.datasets[0]
        if dataset == "digits":
            t = cached(Path(cfg.out_dir) / "data" / "multiview-digits.pt", _digits_tensors)
        elif dataset == "npz":
            t = _npz_tensors(cfg.data_dir)
        else:
            raise ValueError(f"dataset must be one of {self.datasets}, got {dataset!r}")
        test = t["is_test"].bool()
        views = [t[k].float() for k in ("primary", "secondary1", "secondary2")]
        label = t["label"].long()
        train = TensorDataset(*(x[~test] for x in views), label[~test])
        return DataBundle(
            train=train, test=TensorDataset(*(x[test] for x in views), label[test]),
            info={"n_classes": int(label.max()) + 1, "view_dims": tuple(int(x.shape[-1]) for x in views),
                  "regions": tuple(int(x.shape[1]) for x in views)},
        )

    def build_model(self, arm: str, cfg: RunConfig, data: DataBundle) -> nn.Module:
        if arm not in self.arms:
            raise ValueError(f"arm must be one of {list(self.arms)}, got {arm!r}")
        return FusionClassifier(data.info["view_dims"], data.info["regions"], fusion=self.arms[arm]["fusion"],
                                d_model=int(cfg.sizes.get("d_model", 32)),
                                num_heads=int(cfg.sizes.get("num_heads", 2)),
                                num_classes=data.info["n_classes"])

    def configure_optimizers(self, model: nn.Module, cfg: RunConfig, lr: float, epochs: int) -> Any:  # noqa: ARG002
        """AdamW(lr); the HNAS mixing logits at ``sizes["hnas_lr"]`` when set (see
        :mod:`attnopt.experiments._hnas_optim`: at the model's LR the weight cannot move far)."""
        from attnopt.experiments._hnas_optim import hnas_adamw

        h = cfg.sizes.get("hnas_lr")
        return hnas_adamw(model, lr, None if h is None else float(h))

    def training_loss(self, model: nn.Module, batch: Any, cfg: RunConfig) -> Tensor:  # noqa: ARG002
        *views, y = batch
        return nn.functional.cross_entropy(model(*views), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Any, data: DataBundle, cfg: RunConfig) -> dict[str, float]:  # noqa: ARG002
        from torchmetrics.functional.classification import multiclass_accuracy

        preds, target = [], []
        for *views, y in loader:
            preds.append(model(*views).argmax(-1))
            target.append(y)
        acc = multiclass_accuracy(torch.cat(preds), torch.cat(target), num_classes=data.info["n_classes"],
                                  average="micro")
        return {"accuracy": 100.0 * float(acc), **hnas_weights(model)}

    def epoch_diagnostics(self, model: nn.Module, data: DataBundle, cfg: RunConfig,  # noqa: ARG002
                          epoch: int) -> dict[str, float]:  # noqa: ARG002
        out: dict[str, float] = dict(hnas_weights(model))
        attn = getattr(model, "attention", None)
        if attn is not None:
            from torch.utils.data import DataLoader

            probe = Subset(data.train, list(range(min(512, dataset_len(data.train)))))
            loader = DataLoader(probe, batch_size=256)
            out.update(column_mass_over(model, loader, lambda m, b: m(*b[:-1]),
                                        select=lambda _n, mod: mod is attn))
        return out

    def figures(self, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        from attnopt.experiments._dn_figures import column_mass_figure, hnas_weight_figure

        paths = [column_mass_figure(records, Path(out_dir), name="multiview_fig1_column_mass")]
        paths.append(hnas_weight_figure(records, Path(out_dir), name="multiview_fig3_hnas_weight"))
        return [p for p in paths if p is not None]


TASK = MultiviewFusionTask()
