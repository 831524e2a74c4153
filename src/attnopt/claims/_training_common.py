"""What the trained claims share: the scale note read from the run records.

A record is what :func:`attnopt.experiments._engine.run_task` returns for one run: ``arm``,
``seed``, ``fold``, ``dataset``, ``metrics`` (name -> number), ``history`` and ``config``
(the run's :meth:`~attnopt.experiments.RunConfig.to_json`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attnopt.claims import ClaimContext

__all__ = ["describe_runs", "scale_note"]


# ---- the scale note ----------------------------------------------------------------------------
def _distinct(xs: Iterable[Any]) -> str:
    """The distinct values of ``xs`` (numbers in numeric order), joined by ``/``; ``None`` left out."""
    vals = {x if isinstance(x, (int, float, str)) else repr(x) for x in xs if x is not None}
    ordered = sorted(vals, key=lambda v: (1, v, 0.0) if isinstance(v, str) else (0, "", float(v)))
    return "/".join(str(v) for v in ordered)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def describe_runs(configs: Sequence[Mapping[str, Any]]) -> str:
    """One line naming the scale of runs from their configs (``RunConfig.to_json()`` dicts).

    Seeds and folds are counted; epochs, batch size, data set and every size knob are listed
    (values that differ between runs joined by ``/``), e.g. ``"5 seeds, 20 epochs, batch size
    32; d_model=64, num_heads=8"``.
    """
    if not configs:
        return "no runs"
    seeds = {c.get("seed") for c in configs}
    folds = {c.get("fold", 0) for c in configs}
    head = _plural(len(seeds), "seed") + (f" × {len(folds)} folds" if len(folds) > 1 else "")
    parts = [head, f"{_distinct(c.get('epochs') for c in configs)} epochs"]
    batch = _distinct(c.get("batch_size") for c in configs)
    if batch:
        parts.append(f"batch size {batch}")
    datasets = _distinct(c.get("dataset") for c in configs)
    if datasets:
        parts.append(f"data {datasets}")
    keys: dict[str, None] = {}
    for c in configs:
        keys.update(dict.fromkeys(c.get("sizes") or {}))
    sizes = ", ".join(f"{k}={_distinct((c.get('sizes') or {}).get(k) for c in configs)}" for k in keys)
    return ", ".join(parts) + (f"; {sizes}" if sizes else "")


def scale_note(
    ctx: ClaimContext,
    recs: Sequence[Mapping[str, Any]],
    what: str,
    *,
    planned: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
) -> str:
    """The paragraph that ends a trained claim's details: the scale that actually ran.

    The scale is read from the records' ``config`` (what ran); records without one (hand-made)
    fall back to ``planned()`` (the configs the claim would run at this scale), said as such.
    ``what`` describes the model and data, independent of the scale.
    """
    configs = [r["config"] for r in recs if isinstance(r.get("config"), Mapping)]
    if configs:
        ran = describe_runs(configs) + " (from the runs' configs)"
    elif planned is not None:
        ran = describe_runs(planned()) + " (as planned; the records carry no config)"
    else:
        ran = "scale unknown (the records carry no config)"
    mode = "quick" if ctx.quick else "full"
    return (
        f"\n\nScale ({mode}): {what}; {ran}. The paper's data are not available offline; "
        "see the task's docstring for the stand-in."
    )
