"""What a training task declares: its paper table, arms, data, model, loss and metrics.

A task module (``attnopt/experiments/<task>.py``) defines ``TASK = MyTask()``; the engine
(:mod:`attnopt.experiments._engine`) runs one Lightning fit per (arm, seed, lr, fold) and
knows nothing of the science. See ``TRAINING_CONTRACT.md`` / design.md "Training side".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

__all__ = ["RunConfig", "DataBundle", "Scale", "Task", "Fit", "dataset_len"]

Fit = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class RunConfig:
    """One Lightning fit: one (arm, seed, lr, fold) of a task.

    Attributes:
        task, arm: names.  seed: run seed.  lr: learning rate.  epochs, batch_size: schedule.
        fold: cross-validation fold (``0`` when the task has one split).
        quick: the task's quick scale (sizes in ``sizes``).
        dataset: ``None`` = the task's offline default (``Task.datasets[0]``).
        data_dir: where the paper's data lie in their standard formats (``--data-dir``).
        out_dir: the experiment's output directory.
        sizes: task-specific size knobs (``Scale.sizes`` merged with the caller's).
        kl_weight: weight of :func:`attnopt.models.auxiliary_loss` added by the engine.
    """

    task: str
    arm: str
    seed: int
    lr: float
    epochs: int
    batch_size: int
    fold: int = 0
    quick: bool = False
    dataset: str | None = None
    data_dir: Path | None = None
    out_dir: Path = Path("attnopt-train")
    sizes: Mapping[str, Any] = field(default_factory=dict)
    kl_weight: float = 1.0

    def size(self, key: str, default: Any = None) -> Any:
        """``sizes[key]`` or ``default``."""
        return self.sizes.get(key, default)

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict of the config (paths as strings)."""
        return {
            "task": self.task,
            "arm": self.arm,
            "seed": self.seed,
            "lr": self.lr,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "fold": self.fold,
            "quick": self.quick,
            "dataset": self.dataset,
            "data_dir": None if self.data_dir is None else str(self.data_dir),
            "out_dir": str(self.out_dir),
            "sizes": dict(self.sizes),
            "kl_weight": self.kl_weight,
        }


@dataclass
class DataBundle:
    """A task's data: ``train``/``test`` (and optional ``val``) datasets, a ``collate_fn``
    for the loaders, and ``info`` (``n_classes``, ``vocab_size``, ... for the model)."""

    train: Dataset
    test: Dataset
    val: Dataset | None = None
    collate_fn: Callable[..., Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def dataset_len(dataset: Dataset) -> int:
    """The number of items of a map-style dataset (``torch.utils.data.Dataset`` declares no ``__len__``).

    Raises:
        TypeError: ``dataset`` has no length (an iterable-style dataset; the engine samples
            map-style datasets by index).
    """
    if not isinstance(dataset, Sized):
        raise TypeError(f"a task's datasets must be map-style with a length, got {type(dataset).__name__}")
    return len(dataset)


@dataclass(frozen=True)
class Scale:
    """A task's quick or full scale: ``epochs``, number of ``seeds``, ``batch_size``, ``sizes``."""

    epochs: int
    seeds: int
    batch_size: int
    sizes: Mapping[str, Any] = field(default_factory=dict)


class Task:
    """Base class of a training task (subclass once per paper experiment; ``TASK = MyTask()``).

    Class attributes to set: ``name`` (CLI name), ``paper``, ``table``, ``metric`` (key of
    :meth:`evaluate`'s dict that the table reports), ``higher_is_better``, ``arms``
    (arm -> model options), ``default_arms``, ``lr_grid``, ``datasets`` (first = offline
    default), ``paper_results`` (dataset -> arm -> paper number), ``quick``/``full``
    (:class:`Scale`), ``folds``.

    Subclasses implement :meth:`build_data`, :meth:`build_model`, :meth:`training_loss` and
    :meth:`evaluate`; the other methods are optional hooks with working defaults.
    """

    name: str = ""
    paper: str = ""
    table: str = ""
    metric: str = "accuracy"
    higher_is_better: bool = True
    arms: Mapping[str, Mapping[str, Any]] = {}
    default_arms: tuple[str, ...] = ()
    #: default arms at quick scale when some default arms are too slow for it (None: ``default_arms``)
    quick_arms: tuple[str, ...] | None = None
    lr_grid: tuple[float, ...] = (1e-3,)
    datasets: tuple[str, ...] = ("default",)
    paper_results: Mapping[str, Mapping[str, float]] = {}
    quick: Scale = Scale(epochs=2, seeds=1, batch_size=32)
    full: Scale = Scale(epochs=10, seeds=5, batch_size=32)
    folds: int = 1
    description: str = ""
    #: the unit ``metric`` is shown in (results.md), e.g. ``"%"``; the paper's numbers beside it too
    metric_unit: str = ""
    #: factor from :meth:`evaluate`'s ``metric`` to ``metric_unit`` (100: a fraction shown in %)
    metric_scale: float = 1.0
    #: factor from ``paper_results`` to ``metric_unit`` (100: the paper gives a fraction)
    paper_scale: float = 1.0
    #: size knobs the task reads (``cfg.size(key, default)``) that neither scale sets -> their type
    extra_sizes: Mapping[str, type] = {}

    # --- what every task implements -------------------------------------------------------
    def build_data(self, cfg: RunConfig) -> DataBundle:
        """The data of this run (deterministic; offline by default; ``cfg.data_dir`` for the paper's data)."""
        raise NotImplementedError

    def build_model(self, arm: str, cfg: RunConfig, data: DataBundle) -> nn.Module:
        """The model of ``arm`` (from :mod:`attnopt.models` and the registry)."""
        raise NotImplementedError

    def training_loss(self, model: nn.Module, batch: Any, cfg: RunConfig) -> Tensor:
        """Scalar task loss of one batch (the engine adds the auxiliary loss)."""
        raise NotImplementedError

    def evaluate(
        self, model: nn.Module, loader: Iterable[Any], data: DataBundle, cfg: RunConfig
    ) -> dict[str, float]:
        """Test metrics (``self.metric`` among them); the model is in eval mode, no grad.

        ``loader`` yields the test set's batches (the engine's are already on the model's device);
        it is an iterable, not necessarily a ``DataLoader``.
        """
        raise NotImplementedError

    # --- optional hooks ----------------------------------------------------------------------
    def train_batch_transform(self, batch: Any, cfg: RunConfig, generator: torch.Generator) -> Any:  # noqa: ARG002
        """Transform a training batch (e.g. OT-ViT's bank protocol); ``generator`` is seeded
        per (seed, epoch) so resumed runs draw the same. Default: unchanged."""
        return batch

    def configure_optimizers(self, model: nn.Module, cfg: RunConfig, lr: float, epochs: int) -> Any:  # noqa: ARG002
        """What Lightning's ``configure_optimizers`` returns. Default: ``AdamW(lr)``, no schedule."""
        return torch.optim.AdamW(model.parameters(), lr=lr)

    def epoch_diagnostics(
        self,
        model: nn.Module,  # noqa: ARG002
        data: DataBundle,  # noqa: ARG002
        cfg: RunConfig,  # noqa: ARG002
        epoch: int,  # noqa: ARG002
    ) -> dict[str, float]:
        """Scalars logged into ``history`` at the end of each epoch. Default: none."""
        return {}

    def figures(self, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:  # noqa: ARG002
        """The task's diagnostic figures (PNG paths written into ``out_dir``). Default: none."""
        return []

    def run(self, cfg: RunConfig, fit: Fit) -> dict[str, Any]:
        """One run: default ``fit(model, data, cfg)``; override for multi-stage tasks.

        ``fit(model, data, cfg, stage="main", epochs=None, lr=None)`` is the engine's Lightning
        fit; it returns ``{"metrics", "history", "wall_time_s", "step_time_s", ...}``. A
        multi-stage task calls it once per stage (distinct ``stage`` names: each has its own
        checkpoints) and returns the final stage's dict (with any extra keys it wants kept).
        """
        data = self.build_data(cfg)
        model = self.build_model(cfg.arm, cfg, data)
        return fit(model, data, cfg)

    # --- helpers -----------------------------------------------------------------------------
    def scale(self, quick: bool) -> Scale:
        """``self.quick`` or ``self.full``."""
        return self.quick if quick else self.full

    def check_arm(self, arm: str) -> None:
        """Raise ``ValueError`` naming the valid arms if ``arm`` is not one."""
        if arm not in self.arms:
            raise ValueError(f"task {self.name!r} has no arm {arm!r}; valid arms: {', '.join(self.arms)}")

    def size_keys(self) -> dict[str, tuple[type, Any, Any]]:
        """Every valid size key -> (its type, quick default, full default); ``None``: the task's own."""
        out: dict[str, tuple[type, Any, Any]] = {}
        for k in sorted({*self.quick.sizes, *self.full.sizes, *self.extra_sizes}):
            q, f = self.quick.sizes.get(k), self.full.sizes.get(k)
            typ = self.extra_sizes.get(k) or type(q if q is not None else f)
            out[k] = (str if typ is type(None) else typ, q, f)
        return out

    def check_sizes(self, sizes: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the valid keys if a key of ``sizes`` is not one."""
        valid = self.size_keys()
        unknown = [k for k in sizes if k not in valid]
        if unknown:
            raise ValueError(
                f"task {self.name!r} has no size {', '.join(map(repr, unknown))}; valid sizes: "
                + (", ".join(valid) or "none")
            )

    def check_dataset(self, dataset: str | None) -> str:
        """The dataset name (default: the first); ``ValueError`` naming the valid ones."""
        if dataset is None:
            return self.datasets[0]
        if dataset not in self.datasets:
            raise ValueError(
                f"task {self.name!r} has no dataset {dataset!r}; valid: {', '.join(self.datasets)}"
            )
        return dataset
