"""fenchel-dual-attention Sec. 9, Tables 1–2: OT-ViT vs ViT, trained (reduced scale).

Both claims judge the same runs of the ``ot-vit`` training task (:mod:`attnopt.experiments.ot_vit`):
every arm (``vit``, ``ot-vit``) × an LR grid (the paper's {3e-3, 3e-4, 3e-5} in full mode; with
1e-2 added above at quick and standard scale, where the paper's top edge is the best LR) ×
seeds (3 at quick, 5 × 15 epochs of the quick widths at standard, the paper's 5 in full mode)
on scikit-learn's digits (the offline stand-in for CIFAR; the paper's data sets are read with
``attnopt train ot-vit --dataset ... --data-dir``).
Measuring (:func:`measure`) and judging (:func:`judge_table1`, :func:`judge_table2`) are
separate so that negative controls can mutate cheaply. The verdicts follow the one rule of
:mod:`attnopt.claims._verdict` (the paired per-seed OT-ViT − ViT difference and its CI, against
0 and the paper's effect) behind a sanity gate: logistic regression on the same pixels.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from attnopt.claims import ClaimContext, ClaimResult, claim
from attnopt.claims._training_common import gate_text, planned_configs, run_records, scale_note
from attnopt.claims._verdict import (
    Gate,
    Judgement,
    combine,
    effect_of,
    judge_effect,
    sanity_gate,
    training_record,
)

PAPER = "fenchel_dual"
_CACHE: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


#: the LR grid at quick scale: the paper's {3e-3, 3e-4, 3e-5} has its best LR for both arms at
#: its top edge on digits and 3e-5 at chance in a few epochs, so 1e-2 is added above (standard
#: runs {1e-2, 3e-3, 3e-4}). Quick trains one LR, 1e-2 (the best of both arms at quick scale
#: in the previous 3-LR quick runs, within 0.05), for 3 epochs: the OT-ViT runs are the
#: costliest of the quick report (3 LRs × 6 epochs took ~60-180 s of the 5-minute budget). The
#: quick verdict is then honestly "inconclusive" (no LR grid, models far below logistic regression).
QUICK_LRS = (1e-2,)
QUICK_EPOCHS = 3
#: standard scale: the quick widths (the full widths cost ~25 CPU-s an epoch here, measured,
#: and sit at chance after 2 epochs) trained 15 epochs, 5 seeds, over {1e-2, 3e-3, 3e-4} (3e-5
#: sits at chance; the grid keeps a value on each side of the quick run's best), sized so that
#: the whole standard report fits about an hour of CPU here (README: "Reproduction scales and
#: their cost")
STANDARD = {"seeds": 5, "epochs": 15, "lrs": (1e-2, 3e-3, 3e-4)}


def _run_args(ctx: ClaimContext, task: str) -> tuple[str, dict[str, Any]]:
    """The task and ``run_task`` keywords of the claims' runs at the context's scale."""
    from attnopt.experiments import get_task

    quick = ctx.scale == "quick"
    n = STANDARD["seeds"] if ctx.scale == "standard" else get_task(task).scale(quick).seeds
    kwargs: dict[str, Any] = {"quick": ctx.scale != "full",  # standard: the quick widths, longer
                              "seeds": [ctx.seed + i for i in range(int(n))],
                              "out_dir": Path(ctx.out_dir) / "train" / task, "resume": ctx.resume}
    if ctx.scale == "standard":
        kwargs["lrs"] = list(STANDARD["lrs"])
        kwargs["epochs"] = int(STANDARD["epochs"])
    elif quick and get_task(task).lr_grid == (3e-3, 3e-4, 3e-5):  # negative controls shrink the grid
        kwargs["lrs"] = list(QUICK_LRS)
        kwargs["epochs"] = QUICK_EPOCHS
    return task, kwargs


def measure(ctx: ClaimContext) -> list[dict[str, Any]]:
    """The records of every (arm, lr, seed) run; computed once per report (both claims share them)."""
    return run_records(_CACHE, ctx, "ot-vit", _run_args)


def _with_scale(ctx: ClaimContext, records: list[dict[str, Any]], result: ClaimResult) -> ClaimResult:
    """``result`` with the scale note of the runs appended to its details."""
    what = "ViT and OT-ViT over the LR grid"
    note = scale_note(ctx, records, what, planned=lambda: planned_configs(ctx, "ot-vit", _run_args))
    return replace(result, details=result.details + note)


def _stats(
    records: list[dict[str, Any]], dataset: str | None = None
) -> dict[tuple[str, float], dict[str, Any]]:
    from attnopt.experiments._results import summarize

    return {
        (arm, lr): s
        for (ds, arm, lr), s in summarize(records, "accuracy").items()
        if dataset is None or ds == dataset
    }


#: the paper's OT-ViT − ViT accuracy (fraction) per data set (Tables 1–2); digits, our offline
#: stand-in, is judged against Fashion-MNIST's, the closest (small greyscale images) and smallest
PAPER_EFFECT = {"cifar100": 0.491 - 0.463, "cifar10": 0.772 - 0.751, "fashion-mnist": 0.937 - 0.928}
PAPER_EFFECT["digits"] = PAPER_EFFECT["fashion-mnist"]


def _paired(records: list[dict[str, Any]], dataset: str | None, lr_ot: float, lr_vit: float) -> list[float]:
    """Per seed: OT-ViT's accuracy at ``lr_ot`` minus ViT's at ``lr_vit`` (one data set)."""
    def vals(arm: str, lr: float) -> dict[int, float]:
        return {int(r["seed"]): float(r["metrics"]["accuracy"]) for r in records
                if r["arm"] == arm and float(r["lr"]) == lr and "accuracy" in r.get("metrics", {})
                and (dataset is None or str(r.get("dataset")) == dataset)}

    a, b = vals("ot-vit", lr_ot), vals("vit", lr_vit)
    return [a[k] - b[k] for k in sorted(set(a) & set(b))]


def _gate(best: dict[str, float], baseline: float | None) -> Gate | None:
    """The sanity gate: each arm's mean at its chosen LR against logistic regression on the pixels."""
    from attnopt.claims._sanity import BASELINES

    if baseline is None or math.isnan(baseline):
        return None
    b = BASELINES["ot-vit"]
    return sanity_gate(best, name=b.name, value=baseline, margin=b.margin, chance=b.chance)


def _fmt(s: dict[str, Any]) -> str:
    return f"{s['mean']:.3f} ± {s['ci']:.3f}"


def judge_table1(records: list[dict[str, Any]], *, baseline: float | None = None) -> ClaimResult:
    """Table 1: at each model's best LR, OT-ViT's accuracy ≥ ViT's (paper: 0.491 vs 0.463 at 3e-4).

    The paired per-seed difference (OT-ViT at its best LR − ViT at its best LR) is judged by the
    one rule (:mod:`attnopt.claims._verdict`) with the paper's effect for this data set, gated by
    logistic regression on the same pixels (``baseline``). The best LR is the one with the
    highest mean test accuracy (as the paper's Table 1; no validation split is held out).
    """
    st = _stats(records)
    best = {}
    for arm in ("vit", "ot-vit"):
        cands = {lr: s for (a, lr), s in st.items() if a == arm}
        if not cands:
            raise ValueError(f"no records for arm {arm!r}")
        lr = max(cands, key=lambda x: cands[x]["mean"])
        best[arm] = (lr, cands[lr])
    datasets = sorted({str(r.get("dataset")) for r in records})
    ds = datasets[0] if len(datasets) == 1 else None
    gate = _gate({a: b[1]["mean"] for a, b in best.items()}, baseline)
    eff = effect_of(_paired(records, None, best["ot-vit"][0], best["vit"][0]),
                    paper=PAPER_EFFECT.get(ds or "", PAPER_EFFECT["cifar100"]))
    j = judge_effect(eff, gate=gate)
    seeds = best["vit"][1]["seeds"]
    lrs = sorted({lr for _, lr in st})
    rows = ["| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "| --- |" + " --- |" * len(lrs)]
    for arm in ("vit", "ot-vit"):
        rows.append(
            f"| {arm} | " + " | ".join(_fmt(st[(arm, lr)]) if (arm, lr) in st else "—" for lr in lrs) + " |"
        )
    edge = [a for a, (lr, _) in best.items() if len(lrs) > 1 and lr in (lrs[0], lrs[-1])]
    edge_txt = f"; best LR at the grid's edge for {', '.join(edge)}" if edge else ""
    return ClaimResult(
        verdict=j.verdict,
        summary=(
            f"best-LR test accuracy on digits (reduced ViT, {len(seeds)} seeds, mean ± 95 % CI): OT-ViT "
            f"{_fmt(best['ot-vit'][1])} at lr {best['ot-vit'][0]:g} vs ViT {_fmt(best['vit'][1])} at lr "
            f"{best['vit'][0]:g}{edge_txt}{gate_text(gate)} (paper, CIFAR-100: 0.491 vs 0.463 at 3e-4). "
            f"Verdict: {j.verdict} — {j.reason}."
        ),
        figures={
            "ot_vit_best": round(best["ot-vit"][1]["mean"], 4),
            "vit_best": round(best["vit"][1]["mean"], 4),
            "ot_vit_best_lr": best["ot-vit"][0],
            "vit_best_lr": best["vit"][0],
            "seeds": len(seeds),
            "logistic_regression": None if gate is None else round(gate.value, 4),
        },
        details="Test accuracy, mean ± 95 % Student-t CI over seeds "
        + str(seeds)
        + ":\n\n"
        + "\n".join(rows),
        reason=j.reason,
        training=training_record(
            metric="accuracy", higher_is_better=True,
            arms={a: best[a][1]["values"] for a in ("vit", "ot-vit")}, gate=gate, effect=eff),
    )


def judge_table2(records: list[dict[str, Any]], *, baseline: float | None = None) -> ClaimResult:
    """Table 2: OT-ViT ≥ ViT on each data set available (digits offline), at the LR selected as in
    the paper — the one best for both models in the LR grid (the paper: 3e-4 from its Table 1;
    here the LR with the highest mean accuracy of the two arms). Per data set the paired
    per-seed difference is judged by the one rule with that data set's paper effect; the data
    sets combine by :func:`~attnopt.claims._verdict.combine`; gated by logistic regression."""
    from attnopt.experiments._results import summarize

    summ = summarize(records, "accuracy")
    datasets = sorted({ds for ds, _, _ in summ})
    parts: dict[str, Judgement] = {}
    texts, figs = [], {}
    record = None
    for ds in datasets:
        lrs = sorted({lr for d, _, lr in summ if d == ds})
        both = {x: [summ[(ds, a, x)]["mean"] for a in ("vit", "ot-vit") if (ds, a, x) in summ] for x in lrs}
        lr = max(lrs, key=lambda x: sum(both[x]) / max(len(both[x]), 1))
        ot, vit = summ.get((ds, "ot-vit", lr)), summ.get((ds, "vit", lr))
        if ot is None or vit is None:
            continue
        gate = _gate({"vit": vit["mean"], "ot-vit": ot["mean"]}, baseline)
        eff = effect_of(_paired(records, ds, lr, lr), paper=PAPER_EFFECT.get(ds))
        parts[ds] = judge_effect(eff, gate=gate)
        texts.append(f"{ds} (lr {lr:g}, n={ot['n']}): OT-ViT {_fmt(ot)} vs ViT {_fmt(vit)}{gate_text(gate)}")
        figs[f"{ds}_ot_vit"], figs[f"{ds}_vit"] = round(ot["mean"], 4), round(vit["mean"], 4)
        if record is None:
            arms = {"vit": vit["values"], "ot-vit": ot["values"]}
            record = training_record(metric="accuracy", higher_is_better=True, arms=arms, gate=gate,
                                     effect=eff)
    if not parts:
        raise ValueError("no data set has both arms")
    j = combine(parts)
    return ClaimResult(
        verdict=j.verdict,
        summary="; ".join(texts)
        + f" (paper: 0.937/0.928 Fashion-MNIST, 0.772/0.751 CIFAR-10, 0.491/0.463 CIFAR-100). "
        f"Verdict: {j.verdict} — {j.reason}.",
        figures=figs,
        details="Reduced scale: scikit-learn digits (8×8) stand in for the paper's data sets, which run "
        "with `attnopt train ot-vit --dataset fashion-mnist|cifar10|cifar100 --data-dir DIR`.",
        reason=j.reason,
        training=record,
    )


def _baseline(records: list[dict[str, Any]]) -> float:
    from attnopt.claims._sanity import baseline

    return baseline("ot-vit", records)


@claim(
    paper=PAPER,
    key="ot_vit_table1",
    title="OT-ViT: best-LR accuracy ≥ ViT's (LR grid, trained)",
    reference="Sec. 9, Table 1",
    requires=("plots", "train"),
)
def table1(ctx: ClaimContext) -> ClaimResult:
    """Train ViT and OT-ViT over the LR grid and seeds; compare the best-LR accuracies."""
    recs = measure(ctx)
    result = _with_scale(ctx, recs, judge_table1(recs, baseline=_baseline(recs)))
    ctx.attach_figures(Path(ctx.out_dir) / "train" / "ot-vit" / "figures",
                       "ot_vit_accuracy_vs_lr.png", "learning_curves.png")
    return result


@claim(
    paper=PAPER,
    key="ot_vit_table2",
    title="OT-ViT ≥ ViT on every data set available (trained)",
    reference="Sec. 9, Table 2",
    requires=("plots", "train"),
)
def table2(ctx: ClaimContext) -> ClaimResult:
    """At the LR best for both models (the paper's selection), OT-ViT vs ViT per data set."""
    recs = measure(ctx)
    return _with_scale(ctx, recs, judge_table2(recs, baseline=_baseline(recs)))
