"""What the trained claims share: their runs (cached), per-arm statistics, the mean ± CI
table and the scale note read from the run records.

A record is what :func:`attnopt.experiments._engine.run_task` returns for one run: ``arm``,
``seed``, ``fold``, ``dataset``, ``metrics`` (name -> number), ``history`` and ``config``
(the run's :meth:`~attnopt.experiments.RunConfig.to_json`). Statistics are the mean and the
95 % Student-t CI half-width (:func:`attnopt.experiments._stats.mean_ci`) over the runs that
have the metric; no run gives ``(nan, nan)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attnopt.claims import ClaimContext, Verdict

__all__ = [
    "RunArgs",
    "run_records",
    "planned_configs",
    "mean_ci_or_nan",
    "arm_values",
    "arm_stats",
    "combine_verdicts",
    "judge_pair",
    "gate_of",
    "gate_text",
    "fmt_ci",
    "mean_ci_table",
    "describe_runs",
    "scale_note",
]

#: ``(task object or name, run_task keywords)`` of a claim's runs of a task at the context's scale
RunArgs = Callable[[ClaimContext, str], tuple[Any, dict[str, Any]]]


# ---- the runs ----------------------------------------------------------------------------------
def run_records(
    cache: dict[tuple[Any, ...], list[dict]], ctx: ClaimContext, task: str, run_args: RunArgs
) -> list[dict]:
    """The engine's records of ``task`` at the context's scale, run once per (task, scale,
    out_dir, seed) and kept in ``cache`` (claims that judge the same runs share them)."""
    key = (task, ctx.scale, str(ctx.out_dir), ctx.seed)
    if key not in cache:
        from attnopt.experiments._engine import run_task

        the_task, kwargs = run_args(ctx, task)
        # the report needs records, not trained weights
        cache[key] = run_task(the_task, **kwargs, progress=False, keep_checkpoints=0)
    return cache[key]


def planned_configs(ctx: ClaimContext, task: str, run_args: RunArgs) -> list[dict[str, Any]]:
    """The configs (``RunConfig.to_json()``) :func:`run_records` would run; nothing is trained."""
    import inspect

    from attnopt.experiments import get_task
    from attnopt.experiments._engine import plan_runs

    the_task, kwargs = run_args(ctx, task)
    the_task = get_task(the_task) if isinstance(the_task, str) else the_task
    accepted = inspect.signature(plan_runs).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # e.g. run_task's resume
    return [c.to_json() for c in plan_runs(the_task, **kwargs)]


# ---- statistics --------------------------------------------------------------------------------
def mean_ci_or_nan(values: Iterable[float]) -> tuple[float, float]:
    """(mean, 95 % CI half-width) of ``values``; ``(nan, nan)`` when there are none."""
    from attnopt.experiments._stats import mean_ci

    xs = [float(v) for v in values]
    if not xs:
        return math.nan, math.nan
    m, h = mean_ci(xs)
    return float(m), float(h)


def arm_values(recs: Sequence[Mapping[str, Any]], arm: str, metric: str) -> list[float]:
    """``metric`` of every record of ``arm`` that has it, in record order."""
    return [float(r["metrics"][metric]) for r in recs if r["arm"] == arm and metric in r.get("metrics", {})]


def arm_stats(recs: Sequence[Mapping[str, Any]], arm: str, metric: str) -> tuple[float, float, int]:
    """(mean, 95 % CI half-width, number of runs) of ``metric`` over the records of ``arm``."""
    vals = arm_values(recs, arm, metric)
    return (*mean_ci_or_nan(vals), len(vals))


def combine_verdicts(verdicts: Sequence[Verdict]) -> Verdict:
    """The verdict of several parts by :func:`attnopt.claims._verdict.combine`: reproduced when
    every part is; partially when some part is; not reproduced when some part is contradicted
    and none reproduced; inconclusive otherwise (and with no parts)."""
    from attnopt.claims._verdict import Judgement, combine

    return combine({str(i): Judgement(v, "") for i, v in enumerate(verdicts)}).verdict


def fmt_ci(m: float, h: float, *, digits: int = 2, scale: float = 1.0, n: int | None = None) -> str:
    """``"mean ± half-width"`` (both times ``scale``) with ``digits`` decimals; ``"mean ± —"``
    when ``n`` says there was one run (no interval can be estimated)."""
    return f"{m * scale:.{digits}f} ± " + ("—" if n is not None and n < 2 else f"{h * scale:.{digits}f}")


def mean_ci_table(
    recs: Sequence[Mapping[str, Any]],
    arms: Sequence[str],
    metrics: Sequence[str],
    paper: Mapping[str, Any] | None,
    *,
    count: str = "runs",
    digits: int = 2,
    scale: float = 1.0,
    show_missing: bool = False,
) -> str:
    """A Markdown table: per arm, each metric's mean ± 95 % CI, the number of runs of the first
    metric (column ``count``) and the paper's number beside it (``paper[arm]``, blank if none).

    Arms without records are left out, or with ``show_missing`` get a "not run" row (so the
    paper's number still appears).
    """
    from attnopt.report import markdown_table

    paper = paper or {}
    rows = []
    for arm in arms:
        if not any(r["arm"] == arm for r in recs):
            if show_missing:
                rows.append([arm, *["not run"] * len(metrics), 0, paper.get(arm, "")])
            continue
        stats = [arm_stats(recs, arm, m) for m in metrics]
        cells = [fmt_ci(m_, h_, digits=digits, scale=scale, n=n_) for m_, h_, n_ in stats]
        rows.append([arm, *cells, arm_stats(recs, arm, metrics[0])[2], paper.get(arm, "")])
    return markdown_table(["arm", *[f"{m} (mean ± 95% CI)" for m in metrics], count, "paper"], rows)





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
    mode = ctx.scale
    return (
        f"\n\nScale ({mode}): {what}; {ran}. The paper's data are not available offline; "
        "see the task's docstring for the stand-in."
    )


# ---- the verdict rule, applied to records -------------------------------------------------------
def judge_pair(
    recs: Sequence[Mapping[str, Any]],
    better: str,
    base: str,
    metric: str,
    *,
    higher: bool = True,
    paper: float | None = None,
    gate: Any = None,
    unit: str = "",
) -> tuple[Any, Any]:
    """(:class:`~attnopt.claims._verdict.Judgement`, :class:`~attnopt.claims._verdict.Effect`) of
    ``better`` vs ``base`` on ``metric``: the paired per-run difference, > 0 in the paper's
    direction, judged by :func:`~attnopt.claims._verdict.judge_effect` (``paper``: the paper's
    effect in the same units, ``None`` when it states only the direction)."""
    from attnopt.claims._verdict import effect_of, judge_effect, paired_diffs

    e = effect_of(paired_diffs(recs, better, base, metric, higher=higher), paper=paper)
    return judge_effect(e, gate=gate, unit=unit), e


def gate_of(
    task: str,
    recs: Sequence[Mapping[str, Any]],
    arms: Sequence[str],
    metric: str,
    baseline: float | None,
    *,
    higher: bool = True,
) -> Any:
    """The sanity :class:`~attnopt.claims._verdict.Gate` of ``arms`` (their mean ``metric``)
    against ``task``'s baseline value ``baseline`` (:mod:`attnopt.claims._sanity`); ``None`` when
    no baseline was computed (hand-made records without configs). The best arm must lead by more
    than the task's stated margin and than its own seed/fold noise (its 95 % CI half-width)."""
    from attnopt.claims._sanity import BASELINES
    from attnopt.claims._verdict import sanity_gate

    if baseline is None or not math.isfinite(baseline):
        return None
    b = BASELINES[task]
    stats = {a: arm_stats(recs, a, metric) for a in arms if arm_values(recs, a, metric)}
    return sanity_gate({a: s[0] for a, s in stats.items()}, name=b.name, value=baseline, higher=higher,
                       margin=b.margin, chance=b.chance, required=b.required,
                       noise={a: s[1] for a, s in stats.items()})


def gate_text(gate: Any) -> str:
    """``"; sanity baseline <name> <value> (passed|failed)"`` or empty without a gate."""
    if gate is None:
        return ""
    return (f"; sanity baseline {gate.name} {gate.value:.4g} vs best arm {gate.best_arm} {gate.best:.4g} "
            f"({'passed' if gate.passed else 'failed'})")
