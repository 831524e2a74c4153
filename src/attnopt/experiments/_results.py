"""``results.md`` (the paper's table: mean ± 95 % CI over seeds beside the paper) and figures."""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnopt.experiments._stats import mean_ci
from attnopt.experiments._task import Task

__all__ = ["atomic_write_text", "summarize", "write_results_md", "write_figures", "paper_value",
           "mean_ci_text"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def paper_value(task: Task, dataset: str | None, arm: str, lr: float | None = None) -> float | None:
    """The paper's number for ``arm`` on ``dataset`` (``"arm@lr"`` keys give per-LR numbers)."""
    table: Mapping[str, float] = task.paper_results.get(dataset or "", {})
    if lr is not None and f"{arm}@{lr:g}" in table:
        return table[f"{arm}@{lr:g}"]
    return table.get(arm)


def summarize(
    records: Sequence[Mapping[str, Any]], metric: str
) -> dict[tuple[str, str, float], dict[str, Any]]:
    """``(dataset, arm, lr) -> {"mean", "ci", "n", "values", "seeds"}`` of ``metric``.

    Over seeds (and folds)."""
    groups: dict[tuple[str, str, float], list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        if metric in r.get("metrics", {}):
            groups[(str(r.get("dataset")), str(r["arm"]), float(r["lr"]))].append(r)
    out = {}
    for key, rs in groups.items():
        vals = [float(r["metrics"][metric]) for r in rs]
        m, h = mean_ci(vals)
        out[key] = {
            "mean": m,
            "ci": h,
            "n": len(vals),
            "values": vals,
            "seeds": sorted({r["seed"] for r in rs}),
        }
    return out


def mean_ci_text(mean: float, ci: float, n: int, digits: int = 4) -> str:
    """``"mean ± half-width"``; with one run there is no interval: ``"mean ± —"``."""
    return f"{mean:.{digits}f} ± " + ("—" if n < 2 else f"{ci:.{digits}f}")


def _table(task: Task, records: Sequence[Mapping[str, Any]]) -> list[str]:
    summary = summarize(records, task.metric)
    sc = float(task.metric_scale)
    unit = f"{task.metric_unit}, " if task.metric_unit else ""
    digits = 2 if task.metric_unit == "%" else 4
    lines: list[str] = []
    for ds in sorted({k[0] for k in summary}):
        lines += [
            f"### {ds}",
            "",
            f"| arm | lr | {task.metric} ({unit}mean ± 95 % CI) | n "
            f"| paper ({task.metric_unit or 'same unit'}) | step time (ms) | params |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for (d, arm, lr), s in sorted(
            summary.items(),
            key=lambda kv: (list(task.arms).index(kv[0][1]) if kv[0][1] in task.arms else 99, kv[0][2]),
        ):
            if d != ds:
                continue
            rs = [
                r for r in records if str(r.get("dataset")) == d and r["arm"] == arm and float(r["lr"]) == lr
            ]
            step = sum(float(r.get("step_time_s", 0.0)) for r in rs) / len(rs) * 1e3
            pv = paper_value(task, d, arm, lr)
            lines.append(
                f"| {arm} | {lr:g} | {mean_ci_text(s['mean'] * sc, s['ci'] * sc, s['n'], digits)} "
                f"| {s['n']} | {'—' if pv is None else f'{pv * task.paper_scale:g}'} "
                f"| {step:.2f} | {rs[0].get('n_params', '')} |"
            )
        lines.append("")
    return lines


def _scale_name(scale: set[bool]) -> str:
    return "quick" if scale == {True} else "full" if scale == {False} else "mixed"


def write_results_md(task: Task, records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Write the Markdown results table (atomically) and return its path."""
    scale = {bool(r.get("config", {}).get("quick")) for r in records}
    epochs = sorted({r.get("config", {}).get("epochs") for r in records})
    head = [
        f"# {task.name}: {task.paper}, {task.table}",
        "",
        f"{len(records)} run{'' if len(records) == 1 else 's'} ({_scale_name(scale)} scale, "
        f"epochs {epochs}). Mean ± 95 % Student-t CI over seeds; the paper's numbers come from its own "
        "(larger) setting, so they are a reference, not a target at this scale.",
        "",
    ]
    atomic_write_text(path, "\n".join(head + _table(task, records)) + "\n")
    return path


def write_figures(task: Task, records: list[dict[str, Any]], fig_dir: Path) -> list[Path]:
    """Learning curves (train loss per epoch, mean over seeds per arm and lr) and the task's figures."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no figures (pip install 'attnopt[plots]')", stacklevel=2)
        return []
    fig_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[tuple[str, float], list[list[float]]] = defaultdict(list)
    for r in records:
        losses = [h["train_loss"] for h in r.get("history", []) if "train_loss" in h]
        if losses:
            curves[(r["arm"], float(r["lr"]))].append(losses)
    paths: list[Path] = []
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (arm, lr), runs in sorted(curves.items()):
            n = min(len(c) for c in runs)
            mean = [sum(c[i] for c in runs) / len(runs) for i in range(n)]
            ax.plot(range(1, n + 1), mean, marker="o", label=f"{arm} lr={lr:g} (n={len(runs)})")
        ax.set_xlabel("epoch")
        ax.set_ylabel("training loss (mean over seeds)")
        ax.set_title(f"{task.name}: learning curves")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = fig_dir / "learning_curves.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    paths += task.figures(records, fig_dir)
    return paths
