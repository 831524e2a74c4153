"""The experiment engine: one PyTorch Lightning fit per (arm, seed, lr, fold) of a task.

The only module of attnopt that imports Lightning. Lightning gives the loop, progress bar,
loggers, checkpoints, resume and DDP; this file adds what makes runs comparable and
restartable:

* determinism: ``seed_everything(seed)`` before the model is built; the training order is
  a permutation drawn from a generator seeded by ``(seed, epoch)`` (sharded over DDP ranks
  by :class:`EpochSampler`), never from the global RNG; the global torch RNG state (dropout,
  sampled spectral points) is saved in every checkpoint and restored *when the checkpoint
  is loaded* — so ``kill -9`` then ``--resume`` reproduces an uninterrupted run bit for bit
  on CPU (design.md, "Training side");
* files: checkpoints ``runs/<arm>/seed<s>-lr<lr>[-fold<f>]/checkpoints/epoch=<e>.ckpt``
  written atomically (temp file + ``os.replace``; the two newest kept), a truncated
  checkpoint is detected and the previous one used, checkpoints load with
  ``weights_only=True``; ``record.json`` per finished run and ``results.json`` /
  ``results.md`` / ``figures/`` for the experiment, written by rank 0 only, atomically.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler

from attnopt.experiments import get_task
from attnopt.experiments._results import atomic_write_text, write_figures, write_results_md
from attnopt.experiments._task import DataBundle, RunConfig, Task, dataset_len
from attnopt.models import auxiliary_loss

__all__ = [
    "run_task",
    "run_dir",
    "EpochSampler",
    "latest_checkpoint",
    "atomic_write_text",
    "TrainingInterrupted",
    "existing_runs",
]

_CKPT_RE = re.compile(r"^epoch=(\d+)\.ckpt$")
_KEEP_CHECKPOINTS = 2
_QUIET = (  # Lightning notices that say nothing about this run
    r".*smaller than the logging interval.*",
    r".*exists and is not empty.*",
    r".*LeafSpec.*",
    r".*does not have many workers.*",
    r".*litlogger.*",
)
# Lightning's own info lines (logged through ``logging``, not ``warnings``: a warnings filter
# does not reach them) that say nothing about this run.
_QUIET_INFO = re.compile(
    r"^\s*(GPU available|TPU available|HPU available|IPU available|💡 Tip|`Trainer.fit` stopped"
    r"|LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES|Restoring states from the checkpoint"
    r"|Restored all states from the checkpoint)"
)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a fit: Lightning stopped gracefully; the run's checkpoints are kept.

    A :class:`KeyboardInterrupt` (so callers that catch that still do); ``run`` names the
    interrupted run's folder, from which ``resume=True`` continues.
    """

    def __init__(self, run: Path) -> None:
        super().__init__(str(run))
        self.run = run


class _DropLightningNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _QUIET_INFO.match(record.getMessage())


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Drop :data:`_QUIET_INFO` lines and :data:`_QUIET` warnings while Lightning runs."""
    names = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
    try:  # the logger Lightning's ``rank_zero_info`` really writes to (set at import)
        from lightning_utilities.core import rank_zero as _rz

        names += (_rz.log.name,)
    except (ImportError, AttributeError):
        pass
    loggers = [logging.getLogger(n) for n in dict.fromkeys(names)]
    flt = _DropLightningNotices()
    for lg in loggers:
        lg.addFilter(flt)
    try:
        with warnings.catch_warnings():
            for pattern in _QUIET:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


# --------------------------------------------------------------------------- files
class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temp file, ``fsync``, then ``os.replace``: a checkpoint is whole or absent."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def _checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _CKPT_RE.match(p.name))]
    return sorted(found, reverse=True)


def _checkpoint_history(path: Path) -> list[dict[str, float]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return [dict(h) for h in state.get("attnopt", {}).get("history", [])]


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint in ``ckpt_dir`` that loads with ``torch.load(weights_only=True)``.

    A truncated or otherwise unreadable file is reported with a warning and skipped (the
    previous epoch's checkpoint is used). ``None`` when there is none.
    """
    for _, path in _checkpoints(ckpt_dir):
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means: do not resume from it
            warnings.warn(
                f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc}); using the previous one",
                stacklevel=2,
            )
            continue
        return path
    return None


def run_dir(out_dir: Path, cfg: RunConfig, stage: str = "main") -> Path:
    """``out_dir/runs/<arm>/seed<s>-lr<lr>[-fold<f>][/<stage>]``."""
    name = f"seed{cfg.seed}-lr{cfg.lr:g}" + (f"-fold{cfg.fold}" if cfg.fold else "")
    d = Path(out_dir) / "runs" / cfg.arm / name
    return d if stage == "main" else d / stage


# --------------------------------------------------------------------------- data order
class EpochSampler(Sampler[int]):
    """Indices in an order drawn from a generator seeded by ``(seed, epoch)``, sharded by rank.

    Lightning calls :meth:`set_epoch` at each epoch start (also after a resume). With
    ``world_size > 1`` the permutation is padded by wrapping to a multiple of the world size
    and rank ``r`` takes every ``world_size``-th index from ``r`` (as ``DistributedSampler``).
    """

    def __init__(
        self, n: int, *, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1
    ) -> None:
        self.n, self.seed, self.shuffle, self.rank, self.world_size = n, seed, shuffle, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        if self.world_size > 1:
            total = math.ceil(self.n / self.world_size) * self.world_size
            order = (order * (total // max(self.n, 1) + 1))[:total]
            order = order[self.rank :: self.world_size]
        return iter(order)

    def __len__(self) -> int:
        return math.ceil(self.n / self.world_size) if self.world_size > 1 else self.n


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for ``(seed, epoch)`` (distinct pairs give distinct streams)."""
    return (int(seed) * 1_000_003 + int(epoch) * 7919 + 17) % (2**63 - 1)


class _OnDevice:
    """Iterate a loader, moving each batch to ``device`` (for the tasks' evaluate loops)."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield _move(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _move(v, device) for k, v in batch.items()})  # type: ignore[call-arg]  # dict-like
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_move(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(v, device) for v in batch)
    return batch


# --------------------------------------------------------------------------- Lightning glue
class _TaskModule(L.LightningModule):
    """Wraps a task's plain model: loss = task loss + kl_weight * auxiliary_loss(model)."""

    def __init__(
        self, task: Task, model: nn.Module, data: DataBundle, cfg: RunConfig, lr: float, epochs: int
    ) -> None:
        super().__init__()
        self.task, self.model, self.data, self.cfg, self.lr, self.max_epochs = (
            task,
            model,
            data,
            cfg,
            lr,
            epochs,
        )
        self.history: list[dict[str, float]] = []
        self.step_times: list[float] = []
        self.wall_before = 0.0  # wall time of earlier (interrupted) sessions of this run
        self._has_aux = any(callable(getattr(m, "kl", None)) for m in model.modules())
        self._loss_sum = torch.zeros(())
        self._loss_n = 0
        self._t_step = 0.0
        self._gen = torch.Generator()

    def configure_optimizers(self) -> Any:
        return self.task.configure_optimizers(self.model, self.cfg, self.lr, self.max_epochs)

    def on_train_epoch_start(self) -> None:
        self._gen.manual_seed(epoch_seed(self.cfg.seed + 1, self.current_epoch))
        self._loss_sum = torch.zeros(())
        self._loss_n = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:  # noqa: ARG002
        self._t_step = time.perf_counter()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # noqa: ARG002
        batch = self.task.train_batch_transform(batch, self.cfg, self._gen)
        loss = self.task.training_loss(self.model, batch, self.cfg)
        if self._has_aux and self.cfg.kl_weight:
            loss = loss + self.cfg.kl_weight * auxiliary_loss(self.model)
        self._loss_sum = self._loss_sum + loss.detach().float().cpu()
        self._loss_n += 1
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:  # noqa: ARG002
        self.step_times.append(time.perf_counter() - self._t_step)

    def on_train_epoch_end(self) -> None:
        train_loss = float(self._loss_sum) / max(self._loss_n, 1)
        entry: dict[str, float] = {"epoch": int(self.current_epoch), "train_loss": train_loss}
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            entry.update(
                {
                    k: float(v)
                    for k, v in self.task.epoch_diagnostics(
                        self.model, self.data, self.cfg, int(self.current_epoch)
                    ).items()
                }
            )
        self.model.train(was_training)
        self.history.append(entry)
        if self.logger is not None:
            self.log_dict(
                {k: v for k, v in entry.items() if k != "epoch"},
                on_step=False,
                on_epoch=True,
                sync_dist=True,  # averaged over the processes (each trains on its shard)
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["attnopt"] = {
            "history": [dict(h) for h in self.history],
            "step_times": list(self.step_times),
            "wall_s": self.wall_before + (time.perf_counter() - self._t0),
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("attnopt", {})
        self.history = [dict(h) for h in state.get("history", [])]
        self.step_times = list(state.get("step_times", []))
        self.wall_before = float(state.get("wall_s", 0.0))
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])

    _t0 = 0.0


class _EpochCheckpoint(ModelCheckpoint):
    """Save ``epoch=<e>.ckpt`` every epoch, then keep only the newest ``_KEEP_CHECKPOINTS``.

    Pruning happens right after the save (Lightning runs checkpoint callbacks after all
    others, so a separate pruning callback would run before the save and leave one extra
    file). Two are kept so that a torn newest file falls back to the previous one.
    """

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__(
            dirpath=ckpt_dir,
            filename="epoch={epoch}",
            auto_insert_metric_name=False,
            save_top_k=-1,
            every_n_epochs=1,
            save_on_train_epoch_end=True,
            enable_version_counter=False,
        )
        self.ckpt_dir = ckpt_dir

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if trainer.is_global_zero:
            _prune_checkpoints(self.ckpt_dir, _KEEP_CHECKPOINTS)


def _prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` epoch checkpoints of ``ckpt_dir``."""
    for _, p in _checkpoints(ckpt_dir)[keep:]:
        p.unlink(missing_ok=True)


def _epoch_of(row: Mapping[str, str]) -> float:
    try:
        return float(row.get("epoch") or "nan")
    except ValueError:
        return float("nan")


def _csv_logger(rdir: Path, keep_before_epoch: int, history: Sequence[Mapping[str, float]] = ()) -> Any:
    """Lightning's CSV logger writing ``<run>/logs/metrics.csv``, a row per epoch as it ends.

    Lightning's writer deletes an existing ``metrics.csv`` when it starts; on a resume from
    the checkpoint of epoch ``e`` this one first keeps the rows of epochs ``< e + 1`` (those
    the checkpoint covers; later rows are redone), so the file holds the whole run. An epoch
    the file lacks (a kill between the checkpoint and the row) is filled from the
    checkpoint's ``history``.
    """
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    class _KeepingWriter(ExperimentWriter):
        def __init__(self, log_dir: str) -> None:
            path = Path(log_dir) / self.NAME_METRICS_FILE
            fields: list[str] = []
            kept: list[dict[str, str]] = []
            if keep_before_epoch > 0 and path.is_file() and path.stat().st_size:
                with open(path, newline="", encoding="utf-8") as fh:
                    reader = csv.DictReader(fh)
                    fields = list(reader.fieldnames or [])
                    kept = [r for r in reader if _epoch_of(r) < keep_before_epoch]
            have = {int(_epoch_of(r)) for r in kept if _epoch_of(r) == _epoch_of(r)}
            for h in history:
                if int(h["epoch"]) < keep_before_epoch and int(h["epoch"]) not in have:
                    kept.append({k: str(v) for k, v in h.items()})
            if kept:
                fields = list(dict.fromkeys([*fields, *(k for r in kept for k in r)]))
                kept.sort(key=_epoch_of)
            super().__init__(log_dir)  # removes the old file
            if kept:
                with open(path, "w", newline="", encoding="utf-8") as fh:
                    writer = csv.DictWriter(fh, fieldnames=fields)
                    writer.writeheader()
                    writer.writerows(kept)
                self.metrics_keys = sorted(fields)

    class _KeepingCSVLogger(CSVLogger):
        @property
        def experiment(self) -> Any:
            if self._experiment is None and getattr(rank_zero_only, "rank", 0) == 0:
                self._fs.makedirs(self.root_dir, exist_ok=True)
                self._experiment = _KeepingWriter(log_dir=self.log_dir)
            return super().experiment

    return _KeepingCSVLogger(rdir, name="logs", version="", flush_logs_every_n_steps=1)


def _loggers(
    rdir: Path, keep_before_epoch: int = 0, history: Sequence[Mapping[str, float]] = ()
) -> list[Any]:
    """A CSV logger (per-epoch rows in ``<run>/logs/metrics.csv``), and TensorBoard when installed."""
    loggers: list[Any] = [_csv_logger(rdir, keep_before_epoch, history)]
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger
    except ImportError:
        return loggers
    loggers.append(TensorBoardLogger(rdir, name="tensorboard", version=""))
    return loggers


def _accelerator(devices: int) -> str:
    if torch.cuda.is_available():
        if devices > torch.cuda.device_count():
            raise ValueError(
                f"--devices {devices} but only {torch.cuda.device_count()} CUDA device(s) available"
            )
        return "gpu"
    ncpu = os.cpu_count() or 1
    if devices > ncpu:
        raise ValueError(f"--devices {devices} but this machine has {ncpu} CPU core(s) (no GPU found)")
    return "cpu"


class _Session:
    """What stays the same over the fits of one ``run_task`` call."""

    def __init__(
        self, task: Task, out_dir: Path, devices: int, strategy: str, resume: bool, progress: bool
    ) -> None:
        self.task, self.out_dir, self.devices, self.strategy = task, out_dir, devices, strategy
        self.resume, self.progress = resume, progress
        self.accelerator = _accelerator(devices)
        self.is_global_zero = True
        self.say: Callable[[str], None] | None = None  # one line per fit (the CLI passes print)
        self.label = ""  # "run i/n" of the current run, for those lines

    def fit(
        self,
        model: nn.Module,
        data: DataBundle,
        cfg: RunConfig,
        stage: str = "main",
        epochs: int | None = None,
        lr: float | None = None,
    ) -> dict[str, Any]:
        """One Lightning fit of ``model`` on ``data``, then the task's evaluation on the test set."""
        epochs = cfg.epochs if epochs is None else int(epochs)
        lr = cfg.lr if lr is None else float(lr)
        rdir = run_dir(self.out_dir, cfg, stage)
        ckpt_dir = rdir / "checkpoints"
        ckpt_path = latest_checkpoint(ckpt_dir) if self.resume else None
        done = 0 if ckpt_path is None else int(_CKPT_RE.match(ckpt_path.name).group(1)) + 1  # type: ignore[union-attr]
        if self.say is not None and is_global_zero():
            what = (f"{self.label + ': ' if self.label else ''}arm {cfg.arm}, seed {cfg.seed}, lr {lr:g}"
                    + (f", fold {cfg.fold}" if cfg.fold else "") + ("" if stage == "main" else f", {stage}"))
            if ckpt_path is not None:
                what += f" — resuming from {ckpt_path.name} ({done}/{epochs} epochs done)"
            elif self.resume:
                what += " — no checkpoint, starting from epoch 0"
            self.say(what)
        module = _TaskModule(self.task, model, data, cfg, lr, epochs)
        callbacks: list[Callback] = [_EpochCheckpoint(ckpt_dir)]
        history = [] if ckpt_path is None else _checkpoint_history(ckpt_path)
        logger = _loggers(rdir, keep_before_epoch=done, history=history)
        if not self.progress:
            for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
                logging.getLogger(name).setLevel(logging.WARNING)
        with _quiet_lightning():
            trainer, loader = self._trainer(rdir, epochs, logger, callbacks, data, cfg)
            self.is_global_zero = trainer.is_global_zero
            module._t0 = time.perf_counter()
            if ckpt_path is None and trainer.is_global_zero:
                for _, p in _checkpoints(ckpt_dir):  # a fresh run: old checkpoints must not mix in
                    p.unlink(missing_ok=True)
            sigint = signal.getsignal(signal.SIGINT)
            try:
                trainer.fit(
                    module,
                    train_dataloaders=loader,
                    ckpt_path=None if ckpt_path is None else str(ckpt_path),
                    weights_only=True,
                )
            except SystemExit:  # Lightning turns Ctrl-C into a graceful stop and sys.exit(1)
                if trainer.interrupted:
                    raise TrainingInterrupted(rdir) from None
                raise
            finally:
                with contextlib.suppress(ValueError, TypeError):  # not the main thread
                    signal.signal(signal.SIGINT, sigint)  # Lightning ignores Ctrl-C after one
        t_fit = time.perf_counter()
        metrics = self.evaluate(module.model, data, cfg, trainer.strategy.root_device)
        wall = module.wall_before + (time.perf_counter() - module._t0)
        steps = module.step_times
        return {
            "metrics": metrics,
            "history": module.history,
            "wall_time_s": wall,
            "eval_time_s": time.perf_counter() - t_fit,
            "step_time_s": statistics.median(steps) if steps else float("nan"),
            "n_params": sum(p.numel() for p in module.model.parameters()),
            "steps": int(trainer.global_step),
            "resumed_from": None if ckpt_path is None else ckpt_path.name,
        }

    def _trainer(
        self, rdir: Path, epochs: int, logger: list[Any], callbacks: list[Callback], data: DataBundle,
        cfg: RunConfig,
    ) -> tuple[L.Trainer, DataLoader]:
        trainer = L.Trainer(
            accelerator=self.accelerator,
            devices=self.devices,
            strategy=self.strategy,
            max_epochs=epochs,
            logger=logger,
            callbacks=callbacks,
            enable_progress_bar=self.progress,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
            plugins=[AtomicCheckpointIO()],
            log_every_n_steps=1,
            default_root_dir=rdir,
        )
        sampler = EpochSampler(
            dataset_len(data.train),
            seed=cfg.seed,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
        )
        loader = DataLoader(
            data.train, batch_size=cfg.batch_size, sampler=sampler, collate_fn=data.collate_fn
        )
        return trainer, loader

    def evaluate(
        self, model: nn.Module, data: DataBundle, cfg: RunConfig, device: torch.device
    ) -> dict[str, float]:
        loader = DataLoader(data.test, batch_size=cfg.batch_size, shuffle=False, collate_fn=data.collate_fn)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(model, _OnDevice(loader, device), data, cfg)
        model.train(was_training)
        return {k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------- the public entry
def _positive_float(x: Any, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive number, got {x!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what} must be a positive number, got {x!r}")
    return v


def _positive_int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{what} must be a positive integer, got {x!r}")
    return x


def plan_runs(
    task: Task,
    *,
    arms: Sequence[str] | None = None,
    seeds: int | Sequence[int] | None = None,
    lrs: Sequence[float] | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    quick: bool = False,
    dataset: str | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "attnopt-train",
    sizes: Mapping[str, Any] | None = None,
) -> list[RunConfig]:
    """The :class:`RunConfig` of every run.

    Raises:
        ValueError: an unknown arm, dataset or size key; a non-positive number.
    """
    scale = task.scale(quick)
    defaults = task.quick_arms if quick and task.quick_arms else task.default_arms
    arm_list = list(defaults or task.arms) if arms is None else list(arms)
    if not arm_list:
        raise ValueError("no arms given")
    for a in arm_list:
        task.check_arm(a)
    ds = task.check_dataset(dataset)
    if seeds is None:
        seed_list = list(range(scale.seeds))
    elif isinstance(seeds, int):
        seed_list = list(range(_positive_int(seeds, "seeds")))
    else:
        seed_list = [int(s) for s in seeds]
    lr_list = [_positive_float(x, "lr") for x in (task.lr_grid if lrs is None else lrs)]
    if not lr_list:
        raise ValueError("no learning rates given")
    ep = scale.epochs if epochs is None else _positive_int(epochs, "epochs")
    bs = scale.batch_size if batch_size is None else _positive_int(batch_size, "batch_size")
    task.check_sizes(sizes or {})
    merged = {**dict(scale.sizes), **dict(sizes or {})}
    base = RunConfig(
        task=task.name,
        arm=arm_list[0],
        seed=0,
        lr=lr_list[0],
        epochs=ep,
        batch_size=bs,
        quick=quick,
        dataset=ds,
        data_dir=None if data_dir is None else Path(data_dir),
        out_dir=Path(out_dir),
        sizes=merged,
    )
    return [
        replace(base, arm=a, seed=s, lr=lr, fold=f)
        for a in arm_list
        for lr in lr_list
        for f in range(task.folds)
        for s in seed_list
    ]


def _record(cfg: RunConfig, out: Mapping[str, Any]) -> dict[str, Any]:
    rec = {
        "task": cfg.task,
        "arm": cfg.arm,
        "seed": cfg.seed,
        "lr": cfg.lr,
        "fold": cfg.fold,
        "dataset": cfg.dataset,
    }
    rec.update({k: v for k, v in out.items()})
    rec["config"] = cfg.to_json()
    rec["finished"] = True
    return rec


def run_task(
    task: Task | str,
    *,
    arms: Sequence[str] | None = None,
    seeds: int | Sequence[int] | None = None,
    lrs: Sequence[float] | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    quick: bool = False,
    dataset: str | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "attnopt-train",
    devices: int = 1,
    strategy: str = "auto",
    resume: bool = False,
    progress: bool = True,
    sizes: Mapping[str, Any] | None = None,
    write_report: bool = True,
    threads: int | None = None,
    keep_checkpoints: int = 2,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every (arm, seed, lr, fold) of ``task`` as one Lightning fit; write the results.

    Args:
        task: a :class:`~attnopt.experiments.Task` or its name.
        arms: arms to run (default: ``task.default_arms``; at quick scale ``task.quick_arms`` when set).
        seeds: number of seeds ``0..n-1`` or explicit seeds (default: the scale's).
        lrs: learning rates (default: ``task.lr_grid``).
        epochs, batch_size: override the scale's.
        quick: the task's quick scale instead of its full (paper) scale.
        dataset, data_dir: data set name and the folder with the paper's files.
        out_dir: output folder (``results.json``, ``results.md``, ``figures/``, ``runs/``).
        devices, strategy: Lightning's (``devices=2, strategy="ddp"`` = two processes).
        resume: continue unfinished runs from their last checkpoint; skip finished ones.
        progress: Lightning's progress bar.
        sizes: task-specific size knobs, merged over the scale's.
        write_report: write ``results.md`` and figures at the end.
        threads: torch CPU threads per process; default 1 at quick scale (tiny models: more
            threads only add synchronization, and on a loaded 2-core machine they were 30x
            slower per step), else ``cpu_count // devices``.
        keep_checkpoints: epoch checkpoints each fit keeps once its run has finished and its
            record is written (the newest; at most 2). ``0`` deletes them: a finished run is
            known by its ``record.json``, so ``resume`` still skips it (``attnopt reproduce``
            uses 0; keep the default to load trained models later).
        log: called with one line per fit naming its arm, seed and lr (and, with ``resume``,
            what was skipped as finished or continued from which checkpoint); ``None``: silent.
    Returns:
        one record per run (the entries of ``results.json``).
    Raises:
        ValueError: unknown task/arm/dataset, non-positive numbers, ``devices`` above what
            the machine has, a data folder without the expected files (from the task).
    """
    task = get_task(task) if isinstance(task, str) else task
    out = Path(out_dir)
    devices = _positive_int(devices, "devices")
    if not isinstance(keep_checkpoints, int) or keep_checkpoints < 0:
        raise ValueError(f"keep_checkpoints must be a non-negative int, got {keep_checkpoints!r}")
    configs = plan_runs(
        task,
        arms=arms,
        seeds=seeds,
        lrs=lrs,
        epochs=epochs,
        batch_size=batch_size,
        quick=quick,
        dataset=dataset,
        data_dir=data_dir,
        out_dir=out,
        sizes=sizes,
    )
    session = _Session(task, out, devices, strategy, resume, progress)
    session.say = log
    if session.accelerator == "cpu":
        n_threads = threads or (1 if quick else max(1, (os.cpu_count() or 1) // devices))
        torch.set_num_threads(_positive_int(n_threads, "threads"))
    records: list[dict[str, Any]] = []
    for i, cfg in enumerate(configs):
        rec_path = run_dir(out, cfg) / "record.json"
        session.label = f"run {i + 1}/{len(configs)}"
        if resume and rec_path.is_file():
            try:
                rec = json.loads(rec_path.read_text(encoding="utf-8"))
                if rec.get("finished") and rec.get("config") == json.loads(json.dumps(cfg.to_json())):
                    records.append(rec)
                    if log is not None and is_global_zero():
                        log(f"{session.label}: arm {cfg.arm}, seed {cfg.seed}, lr {cfg.lr:g}"
                            + (f", fold {cfg.fold}" if cfg.fold else "") + " — finished earlier, skipped")
                    continue
            except (OSError, ValueError):
                pass
        if not resume and is_global_zero():
            rec_path.unlink(missing_ok=True)  # starting over: an old record must not count as this run
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        result = task.run(cfg, session.fit)
        rec = _record(cfg, result)
        records.append(rec)
        if session.is_global_zero:
            atomic_write_text(rec_path, json.dumps(rec, indent=1, default=_json_default))
            if keep_checkpoints < _KEEP_CHECKPOINTS:
                for ckpt_dir in run_dir(out, cfg).rglob("checkpoints"):
                    _prune_checkpoints(ckpt_dir, keep_checkpoints)
            atomic_write_text(out / "results.json", json.dumps(records, indent=1, default=_json_default))
    if session.is_global_zero:
        atomic_write_text(out / "results.json", json.dumps(records, indent=1, default=_json_default))
        if write_report:
            write_results_md(task, records, out / "results.md")
            write_figures(task, records, out / "figures")
    return records


def existing_runs(out_dir: str | Path, configs: Sequence[RunConfig]) -> list[Path]:
    """The run folders of ``configs`` under ``out_dir`` that already hold a record or checkpoints."""
    found = []
    for cfg in configs:
        d = run_dir(Path(out_dir), cfg)
        if (d / "record.json").is_file() or any(_checkpoints(c) for c in d.rglob("checkpoints")):
            found.append(d)
    return found


def is_global_zero() -> bool:
    """``False`` in the non-zero ranks of a multi-process run (from the launcher's environment)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0" and os.environ.get(
        "NODE_RANK", "0") == "0"


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
