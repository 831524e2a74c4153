"""Figures of the doubly-normalized paper's training tasks (Fig. 1, Fig. 3, Fig. 4), from run records.

Every function takes the engine's records (``history`` = per-epoch dicts) and returns the
saved path, or ``None`` when the records hold nothing to plot.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["column_mass_figure", "hnas_weight_figure", "hnas_layer_figure", "history_series"]

_COLOURS = {"lnas": "tab:blue", "dnas": "tab:red", "hnas": "tab:purple"}


def _scheme(arm: str) -> str:
    return arm.split("-")[0]


def history_series(records: list[dict[str, Any]], key: str) -> dict[str, list[list[float]]]:
    """``arm -> [per-seed list of history[key] over epochs]`` (records without the key skipped)."""
    out: dict[str, list[list[float]]] = defaultdict(list)
    for r in records:
        vals = [float(h[key]) for h in r.get("history", []) if key in h and h[key] is not None]
        if vals:
            out[r["arm"]].append(vals)
    return dict(out)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [sum(c[i] for c in curves) / len(curves) for i in range(n)]


def _save(fig: Any, out_dir: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def column_mass_figure(records: list[dict[str, Any]], out_dir: Path, *, name: str) -> Path | None:
    """Fig. 1 during training: min column mass × Nk (log) and the explained-away fraction per epoch."""
    mins = history_series(records, "min_column_mass_x_nk")
    fracs = history_series(records, "frac_explained_away")
    if not mins:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")  # no label overlap
    for arm in sorted(mins):
        colour = _COLOURS.get(_scheme(arm))
        for i, c in enumerate(mins[arm]):
            axes[0].plot(range(1, len(c) + 1), [max(v, 1e-12) for v in c], color=colour, alpha=0.7,
                         label=arm if i == 0 else None)
        for i, c in enumerate(fracs.get(arm, [])):
            axes[1].plot(range(1, len(c) + 1), c, color=colour, alpha=0.7, label=arm if i == 0 else None)
    axes[0].axhline(1.0, color="k", ls="--", lw=1, label="1/Nk (Lemma 1)")
    axes[0].axhline(0.1, color="grey", ls=":", lw=1, label="1/(10 Nk)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel(r"$N_k \cdot \min_j \sum_i \pi_{ij}$")
    axes[1].set_ylabel("fraction of keys below 1/(10 Nk)")
    top = max((v for cs in fracs.values() for c in cs for v in c), default=0.0)
    axes[1].set_ylim(-0.01, max(0.05, 1.1 * top))  # a fraction: never a negative axis
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.legend(fontsize=7)
    fig.suptitle("Explaining away during training (paper Fig. 1); one line per seed", fontsize=9)
    return _save(fig, out_dir, name)


def hnas_weight_figure(records: list[dict[str, Any]], out_dir: Path, *, name: str,
                       key: str = "hnas_w/0") -> Path | None:
    """Fig. 3: the HNAS mixing weight over training (one line per seed, per HNAS arm)."""
    series = {a: c for a, c in history_series(records, key).items()}
    if not series:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for arm, curves in sorted(series.items()):
        for i, c in enumerate(curves):
            ax.plot(range(1, len(c) + 1), c, color=_COLOURS["hnas"], alpha=0.6, label=arm if i == 0 else None)
        mean = _mean_curve(curves)
        ax.plot(range(1, len(mean) + 1), mean, "k-", lw=2, label=f"{arm} mean")
    ax.axhline(0.5, color="grey", ls=":", lw=1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("HNAS weight w (1 = DNAS)")
    ax.legend(fontsize=7)
    ax.set_title("HNAS mixing weight during training (paper Fig. 3)", fontsize=9)
    return _save(fig, out_dir, name)


def hnas_layer_figure(weights: dict[str, list[list[float]]], out_dir: Path, *, name: str) -> Path | None:
    """Fig. 4: final HNAS weight per layer (``arm -> per-seed list over layers``), mean ± per-seed points."""
    if not weights:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for arm, per_seed in sorted(weights.items()):
        n = min(len(s) for s in per_seed)
        layers = list(range(1, n + 1))
        mean = [sum(s[i] for s in per_seed) / len(per_seed) for i in range(n)]
        for s in per_seed:
            ax.plot(layers, s[:n], "o", color=_COLOURS["hnas"], alpha=0.4, ms=4)
        ax.plot(layers, mean, "k-o", label=f"{arm} mean")
    ax.axhline(0.5, color="grey", ls=":", lw=1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer")
    ax.set_ylabel("HNAS weight w after pretraining")
    ax.legend(fontsize=7)
    ax.set_title("HNAS weight per layer (paper Fig. 4)", fontsize=9)
    return _save(fig, out_dir, name)

