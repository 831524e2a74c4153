r"""implicit-kernel-attention Tables 2–5 and Figs. 3–5: trained models, reduced scale.

Each claim runs a task of :mod:`attnopt.experiments` (``ika_*``) through the training engine
(quick: tiny models, few epochs, 3 seeds or 3 folds; standard: :data:`STANDARD`; full: the
task's full scale) and judges
the records it returns. Measure (:func:`records`) and judge (``judge_*``) are separate
functions, so negative controls can mutate either cheaply. Runs shared by two claims (Table 3
and Fig. 3, Table 4 and Fig. 4, Table 5 and Fig. 5) are made once per process and output
directory.

Verdicts follow the one rule of :mod:`attnopt.claims._verdict`: per IKA arm, the paired
per-seed (per-fold) difference from SDPA with its 95 % Student-t CI, against 0 and the
paper's effect of that arm, behind a sanity gate (:mod:`attnopt.claims._sanity`: TF-IDF +
logistic regression, copy the source, ridge, logistic regression on node features); the arms
combine as parts (partially reproduced when some hold). The paper's direction: an IKA variant
beats SDPA (Tables 2–5; the fixed kernels are shown beside); SDPA's magnitude term grows
during training while the IKA arms' stays stable (Fig. 3, every arm at p = 2); MIKAN's
weights get sparser as ``p → 0`` and every p beats SDPA (Fig. 4a–c); MIKAN's spectral points
differ from GAT's fixed Gaussian (MMD², Fig. 5a–c) and its heads differ more than GAT's (Fig. 5d).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from attnopt.claims import ClaimContext, ClaimResult, Verdict, claim
from attnopt.claims._training_common import (
    arm_stats,
    arm_values,
    fmt_ci,
    gate_of,
    gate_text,
    judge_pair,
    mean_ci_table,
    planned_configs,
    run_records,
    scale_note,
)
from attnopt.claims._verdict import (
    Gate,
    Judgement,
    combine,
    effect_of,
    judge_effect,
    paired_diffs,
    training_record,
)
from attnopt.report import markdown_table

PAPER = "implicit_kernel"
_CACHE: dict[tuple[Any, ...], list[dict]] = {}

class Judged(NamedTuple):
    """What a judge of one data set returns: verdict, summary, figures, Markdown table, the
    verdict's reason and the report.json ``training`` record."""

    verdict: Verdict
    summary: str
    figures: dict[str, Any]
    table: str
    reason: str = ""
    training: dict[str, Any] | None = None


class _PlanRequired(TypedDict):
    arms: tuple[str, ...]
    dataset: str | None
    sizes: dict[str, Any]
    folds: int | None


class QuickPlan(_PlanRequired, total=False):
    """What a claim trains of one task at quick or standard scale.

    Attributes:
        arms: the arms trained; dataset: the data set (``None``: the task's default); sizes: the
            task's size knobs (merged over the scale's: the task's quick sizes at quick scale,
            its full sizes at standard); folds: cross-validation folds (``None``: the task's own
            split); epochs, seeds: override the scale's; quick_sizes: at standard scale, start
            from the task's quick scale (widths, batch size) rather than its full one.
    """

    epochs: int
    seeds: int
    quick_sizes: bool


_TABLE2_ARMS = (
    "transformer", "rbf-only", "expsin", "linear", "ika-s", "ika-ns", "ikan", "ikan-direct", "mikan",
)
_REGRESSION_P_ARMS = ("transformer", "ikan-direct", "mikan", "mikan-p0.25", "mikan-p0.5", "mikan-p2")

# What each claim trains at quick scale (full: the task's own full scale and arms). Translation
# runs every arm at p = 2 (Fig. 3 compares magnitudes like with like; no p chosen on test).
# Quick is cut to fit the report's 5-minute budget (standard keeps every arm): Table 2 trains
# SDPA and the two IKA arms with the paper's largest TREC effects (IKAN, MIKAN; chosen from the
# paper's numbers, not ours; the fixed kernels are context rows, at standard scale); Fig. 4
# sweeps p over {0.25, 1}; fewer epochs for translation, regression and graphs. Quick may
# honestly answer "inconclusive".
QUICK: dict[str, QuickPlan] = {
    "sentence-classification": {
        "arms": ("transformer", "ikan", "mikan"),
        "dataset": "docstring-module",
        "sizes": {"max_len": 16},
        "folds": None,
    },
    "translation": {
        "arms": ("transformer", "ikan-direct", "mikan"),
        "dataset": None,
        "sizes": {"p": 2.0},
        "folds": None,
        "epochs": 3,
    },
    "regression": {
        "arms": ("transformer", "ikan-direct", "mikan", "mikan-p0.25"),
        "dataset": "co2",
        "sizes": {"folds": 3},
        "folds": 3,
        "epochs": 6,
    },
    "node-classification": {
        "arms": ("gat", "ikan-direct", "mikan"),
        "dataset": "sbm",
        "sizes": {"folds": 3},
        "folds": 3,
        "epochs": 15,
    },
}
# Standard scale: longer than quick with more seeds/folds, so that the paired CIs can get below
# the paper's effects where this machine allows (the report states the runs needed where they
# do not). Sized to fit the whole standard report in about an hour of CPU here (projection in
# README: "Reproduction scales and their cost"): the quick widths (``quick_sizes``) trained for
# more epochs, except node classification (the task's full sizes, 200 epochs: cheap).
STANDARD: dict[str, QuickPlan] = {
    "sentence-classification": {
        "arms": _TABLE2_ARMS, "dataset": "docstring-module", "sizes": {"max_len": 16}, "folds": None,
        "epochs": 15, "seeds": 5, "quick_sizes": True,
    },
    "translation": {
        "arms": ("transformer", "ikan-direct", "mikan"), "dataset": None, "sizes": {"p": 2.0},
        "folds": None, "epochs": 15, "seeds": 8, "quick_sizes": True,
    },
    "regression": {
        "arms": _REGRESSION_P_ARMS, "dataset": "co2", "sizes": {"folds": 10}, "folds": 10, "epochs": 20,
        "quick_sizes": True,
    },
    "node-classification": {
        "arms": ("gat", "ikan-direct", "mikan"), "dataset": "sbm", "sizes": {"folds": 10}, "folds": 10,
    },
}
FULL_ARMS = {"regression": _REGRESSION_P_ARMS}
#: Full scale's size overrides: translation at p = 2 as at quick and standard. The task's own
#: default (p = 4) was picked in a pilot scored on the test numbers; no claim uses a p chosen on
#: any data: p is fixed a priori (translation 2, SDPA's own L2; regression 1, the task's default
#: set before any run) and Fig. 4 reports every p of its sweep without selecting one.
FULL_SIZES = {"translation": {"p": 2.0}}
#: the sentence of the scale notes that says how p was set
P_NOTE = ("p is fixed a priori at every scale, never chosen on data (neither test nor validation): "
          "translation p = 2 in every arm, regression MIKAN p = 1, Fig. 4 reports every p of its sweep")


def _show(ctx: ClaimContext, task: str, *patterns: str) -> None:
    """Link the task's figures (written by the engine under ``train/<task>/figures``) in the report."""
    ctx.attach_figures(Path(ctx.out_dir) / "train" / task / "figures", *patterns)


def _run_args(ctx: ClaimContext, task: str) -> tuple[Any, dict[str, Any]]:
    """The task object and the :func:`~attnopt.experiments._engine.run_task` keywords of the
    claim's runs at the context's scale (:func:`records` runs them, the scale note plans them)."""
    import copy

    from attnopt.experiments import get_task

    the_task = get_task(task)
    kwargs: dict[str, Any] = {
        "quick": ctx.scale == "quick"
        or (ctx.scale == "standard" and bool(STANDARD[task].get("quick_sizes"))),
        "out_dir": Path(ctx.out_dir) / "train" / task,
        "resume": ctx.resume,
        "threads": 1,  # tiny models: one thread each is fastest and leaves the other core free
    }
    if ctx.scale != "full":
        plan = (QUICK if ctx.scale == "quick" else STANDARD)[task]
        if plan.get("epochs"):
            kwargs["epochs"] = plan["epochs"]
        if plan.get("seeds"):
            kwargs["seeds"] = plan["seeds"]
        sizes = dict(plan["sizes"])
        folds = plan["folds"]
        if folds:
            the_task = copy.copy(the_task)
            the_task.folds = folds
            sizes["folds"] = folds
        kwargs.update(arms=list(plan["arms"]), sizes=sizes or None)
        if plan["dataset"]:
            kwargs["dataset"] = plan["dataset"]
    else:
        if task in FULL_ARMS:
            kwargs["arms"] = list(FULL_ARMS[task])
        if task in FULL_SIZES:
            kwargs["sizes"] = dict(FULL_SIZES[task])
    return the_task, kwargs


def records(ctx: ClaimContext, task: str) -> list[dict]:
    """The engine's records of ``task`` at the context's scale (cached per process and out_dir).

    Quick mode trains the arms, data set and sizes of :data:`QUICK`; a plan with ``folds``
    runs that many cross-validation folds (a copy of the task with ``folds`` set, and the
    data builder told the same through ``sizes``).
    """
    return run_records(_CACHE, ctx, task, _run_args)


def paper_effect(
    paper: Mapping[str, Any] | None,
    arm: str,
    baseline: str,
    *,
    higher: bool,
    units: float = 1.0,
    relative_to: float | None = None,
) -> float | None:
    """The paper's effect of ``arm`` over ``baseline`` in our metric's units, > 0 in the paper's
    direction: ``(paper[arm] − paper[baseline]) × units`` (signed by ``higher``), or with
    ``relative_to`` the paper's relative improvement times our baseline's mean (when the paper's
    units differ from ours, e.g. RMSE of differently normalized targets). ``None`` when the
    paper gives no number or no improvement."""
    if not paper:
        return None
    a, b = paper.get(arm), paper.get(baseline)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    sign = 1.0 if higher else -1.0
    d = sign * (float(a) - float(b))
    if not d > 0:
        return None
    if relative_to is not None:
        return d / abs(float(b)) * abs(relative_to) if b else None
    return d * units


def judge_ranking(
    recs: Sequence[dict],
    *,
    metric: str,
    higher: bool,
    baseline: str,
    fixed: Sequence[str],
    ika: Sequence[str],
    paper: Mapping[str, float | str] | None = None,
    scale: float = 1.0,
    gate: Gate | None = None,
    paper_units: float = 1.0,
    relative: bool = False,
) -> Judged:
    """Do the IKA arms beat SDPA (``baseline``)? One part per IKA arm, judged by the one rule.

    Each part is the paired per-run (seed/fold) difference IKA arm − SDPA on ``metric``
    (:func:`~attnopt.claims._training_common.judge_pair`) with the paper's effect of that arm
    (:func:`paper_effect`; ``paper_units`` converts the paper's numbers to ours, ``relative``
    applies the paper's relative improvement to our SDPA mean); the parts combine by
    :func:`~attnopt.claims._verdict.combine`. The fixed kernels are shown beside as context.
    ``gate`` (the task's sanity baseline) makes every part inconclusive when it fails.
    """
    sign = 1.0 if higher else -1.0
    stats = {a: arm_stats(recs, a, metric) for a in (baseline, *fixed, *ika)}
    present = {a: s for a, s in stats.items() if s[2] > 0}
    ika_p = [a for a in ika if a in present]
    fixed_p = [a for a in fixed if a in present]
    if baseline not in present or not ika_p:
        why = f"no records for {baseline} or the IKA arms"
        return Judged("inconclusive", why, {}, "", why)
    base_m, base_h, _ = present[baseline]
    parts: dict[str, Judgement] = {}
    effects = {}
    for a in ika_p:
        eff_paper = paper_effect(paper, a, baseline, higher=higher, units=paper_units,
                                 relative_to=base_m if relative else None)
        parts[f"{a} vs {baseline}"], effects[a] = judge_pair(
            recs, a, baseline, metric, higher=higher, paper=eff_paper, gate=gate)
    j = combine(parts)
    refs = [(baseline, base_m, base_h)] + [(a, *present[a][:2]) for a in fixed_p]
    best_ref = max(refs, key=lambda t: sign * t[1])
    best_ika = max(ika_p, key=lambda a: sign * present[a][0])
    bi_m, bi_h, _ = present[best_ika]
    best_better = sign * (bi_m - best_ref[1]) > 0
    table = mean_ci_table(recs, (baseline, *fixed_p, *ika_p), [metric], paper, digits=3, scale=scale)
    pair_txt = ", ".join(
        f"{a} − {baseline} {fmt_ci(sign * e.mean, e.half or 0.0, digits=3, scale=scale)}"
        for a, e in effects.items() if e.n
    )
    summary = (
        f"paired {pair_txt}; best IKA arm {best_ika} {metric} {fmt_ci(bi_m, bi_h, digits=3, scale=scale)} "
        f"vs best of SDPA/fixed kernels {best_ref[0]} "
        f"{fmt_ci(best_ref[1], best_ref[2], digits=3, scale=scale)}"
        f" ({'better' if best_better else 'not better'}){gate_text(gate)}"
    )
    figures = {f"{a}_{metric}": round(present[a][0] * scale, 4) for a in (baseline, *fixed_p, *ika_p)}
    if gate is not None:
        figures["sanity_baseline"] = round(gate.value * scale, 4)
    # the record's effect: the IKA arm with the paper's largest effect (chosen a priori), else the first
    lead = max(ika_p, key=lambda a: effects[a].paper or -math.inf)
    training = training_record(
        metric=metric, higher_is_better=higher,
        arms={a: arm_values(recs, a, metric) for a in (baseline, *fixed_p, *ika_p)},
        gate=gate, effect=effects[lead],
    )
    return Judged(j.verdict, summary, figures, table, j.reason, training)


def _scale_note(ctx: ClaimContext, recs: Sequence[dict], task: str, what: str) -> str:
    """The scale the records of ``task`` ran at (:func:`~attnopt.claims._training_common.scale_note`)."""
    return scale_note(ctx, recs, what, planned=lambda: planned_configs(ctx, task, _run_args))


def _baselines(task: str, recs: Sequence[dict], default: str) -> dict[str, float]:
    """The task's sanity baseline per data set (:func:`attnopt.claims._sanity.baseline`)."""
    from attnopt.claims._sanity import baseline

    out = {}
    for ds in sorted({r.get("dataset") or default for r in recs}):
        out[ds] = baseline(task, [r for r in recs if (r.get("dataset") or default) == ds])
    return out


def _gate(task: str, recs: Sequence[dict], arms: Sequence[str], metric: str, baseline: float | None,
          *, higher: bool = True) -> Gate | None:
    return gate_of(task, recs, arms, metric, baseline, higher=higher)


@claim(
    paper=PAPER,
    key="table2",
    title="Sentence classification: IKA variants beat SDPA and the fixed kernels",
    requires=("plots", "train"),
    reference="Table 2, Fig. 2",
)
def table2(ctx: ClaimContext) -> ClaimResult:
    """Table 2: the IKA arms against SDPA and the fixed kernels in sentence classification (trained)."""
    recs = records(ctx, "sentence-classification")
    bases = _baselines("sentence-classification", recs, "docstring-module")
    result = judge_table2(recs, ctx, baselines=bases)
    _show(ctx, "sentence-classification", "fig2_attention_*.png", "learning_curves.png")
    return result


# the paper's Table 2 column beside each stand-in: many classes ~ TREC, binary ~ SUBJ
_PAPER_TEXT_COLUMN = {"docstring-module": "TREC", "docstring-kind": "SUBJ"}


def _by_dataset(
    ctx: ClaimContext,
    recs: list[dict],
    task: str,
    default: str,
    judge: Callable[[str, list[dict]], Judged],
    detail: Callable[[str, list[dict], str], str],
    what: str,
) -> ClaimResult:
    """Judge each data set's records apart (``judge(ds, records)`` -> :class:`Judged`; records
    without a data set belong to ``default``) and combine them by
    :func:`~attnopt.claims._verdict.combine`: the summaries joined, the figures prefixed
    ``"<ds>:"``, the details the paragraphs ``detail(ds, records, table)`` and the scale note of
    ``task`` (``what``); report.json's ``training`` record is the first data set's."""
    parts: dict[str, Judgement] = {}
    texts, figs, details = [], {}, []
    training = None
    for ds in sorted({r.get("dataset") or default for r in recs}):
        sub = [r for r in recs if (r.get("dataset") or default) == ds]
        jd = judge(ds, sub)
        parts[ds] = Judgement(jd.verdict, jd.reason)
        texts.append(f"{ds}: {jd.summary}")
        figs.update({f"{ds}:{k}": val for k, val in jd.figures.items()})
        details.append(detail(ds, sub, jd.table))
        training = training if training is not None else jd.training
    j = combine(parts)
    return ClaimResult(
        verdict=j.verdict,
        summary="; ".join(texts) + f". Verdict: {j.verdict} — {j.reason}.",
        figures=figs,
        details="\n\n".join(details) + _scale_note(ctx, recs, task, what),
        reason=j.reason,
        training=training,
    )




def judge_table2(
    recs: list[dict], ctx: ClaimContext, *, baselines: Mapping[str, float] | None = None
) -> ClaimResult:
    """Table 2 per data set: each IKA arm vs SDPA (:func:`judge_ranking`, the paper's effect of
    the matching column in points / 100), gated by TF-IDF + logistic regression (``baselines``:
    data set -> accuracy; ``None``: no gate)."""
    from attnopt.experiments.ika_sentence_classification import PAPER as P2
    from attnopt.experiments.ika_sentence_classification import PAPER_PARAMS_M as P2_PARAMS

    def judge(ds: str, sub: list[dict]) -> Judged:
        b = (baselines or {}).get(ds)
        return judge_ranking(
            sub,
            metric="accuracy",
            higher=True,
            baseline="transformer",
            fixed=("rbf-only", "expsin", "linear"),
            ika=("ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"),
            paper=P2[_PAPER_TEXT_COLUMN.get(ds, "TREC")],
            scale=100.0,
            gate=_gate("sentence-classification", sub, _TABLE2_ARMS, "accuracy", b),
            paper_units=0.01,
        )

    def detail(ds: str, sub: list[dict], table: str) -> str:
        params = {r["arm"]: r.get("n_params") for r in sub}
        column = _PAPER_TEXT_COLUMN.get(ds, "TREC")
        return (
            f"**{ds}** (paper column: {column}, accuracy %)\n\n{table}\n\nparameters per arm: {params} "
            f"(paper, MR, millions: {P2_PARAMS})"
        )

    what = "a Transformer encoder classifier (mean-pooled)"
    return _by_dataset(ctx, recs, "sentence-classification", "docstring-module", judge, detail, what)


def _single(jd: Judged, *, summary: str, figures: dict[str, Any], details: str) -> ClaimResult:
    return ClaimResult(
        verdict=jd.verdict,
        summary=f"{summary}. Verdict: {jd.verdict} — {jd.reason}.",
        figures=figures,
        details=details,
        reason=jd.reason,
        training=jd.training,
    )


@claim(
    paper=PAPER,
    key="table3",
    title="Translation: IKAN-direct and MIKAN reach higher BLEU than SDPA",
    requires=("plots", "train"),
    reference="Table 3",
)
def table3(ctx: ClaimContext) -> ClaimResult:
    """Table 3: BLEU of IKAN-direct / MIKAN against SDPA on German→English number words (trained)."""
    from attnopt.claims._sanity import baseline

    recs = records(ctx, "translation")
    result = judge_table3(recs, ctx, baseline=baseline("translation", recs))
    _show(ctx, "translation", "learning_curves.png")
    return result


_TRANSLATION_ARMS = ("transformer", "ikan-direct", "mikan")


def judge_table3(recs: list[dict], ctx: ClaimContext, *, baseline: float | None = None) -> ClaimResult:
    """Table 3: each IKA arm vs SDPA in BLEU (the paper's numbers are lost: direction only),
    gated by copying the source (``baseline``, BLEU)."""
    gate = _gate("translation", recs, _TRANSLATION_ARMS, "bleu", baseline)
    jd = judge_ranking(
        recs,
        metric="bleu",
        higher=True,
        baseline="transformer",
        fixed=(),
        ika=("ikan-direct", "mikan"),
        paper=dict.fromkeys(_TRANSLATION_ARMS, "n/a"),
        gate=gate,
    )
    exact = {a: arm_stats(recs, a, "exact_match")[0] for a in _TRANSLATION_ARMS}
    return _single(
        jd,
        summary=f"German→English number words, sacrebleu BLEU: {jd.summary}",
        figures={**jd.figures, **{f"{a}_exact_match": round(x, 4) for a, x in exact.items()}},
        details=jd.table
        + "\n\nPaper column: the paper's Table 3 (IWSLT14 De-En BLEU, three runs) survives in our copy "
        "of the paper only as its caption; its numbers are not in the extracted text nor in any source "
        "we could read offline, so none are shown rather than guessed. The paper's claim is the ranking: "
        "IKAN-direct and MIKAN above Transformer."
        + _scale_note(
            ctx, recs, "translation", "a Transformer encoder-decoder, German→English number words, greedy"
            f" decoding; every arm's L^p magnitude at p = sizes['p'] (2: SDPA's own); {P_NOTE}",
        ),
    )


@claim(
    paper=PAPER,
    key="fig3",
    title="Similarity vs magnitude: SDPA leans on a growing magnitude, IKA stays stable",
    requires=("plots", "train"),
    reference="Fig. 3",
)
def fig3(ctx: ClaimContext) -> ClaimResult:
    """Fig. 3: max similarity and mean log magnitude, first epoch vs last, per arm (the Table 3 runs)."""
    from attnopt.claims._sanity import baseline

    recs = records(ctx, "translation")
    result = judge_fig3(recs, ctx, baseline=baseline("translation", recs))
    _show(ctx, "translation", "fig3_similarity_magnitude.png")
    return result


def _start_end(recs: Sequence[dict], arm: str, key: str) -> tuple[float, float]:
    rs = [r for r in recs if r["arm"] == arm and r.get("history") and key in r["history"][0]]
    if not rs:
        return math.nan, math.nan
    start = sum(r["history"][0][key] for r in rs) / len(rs)
    end = sum(r["history"][-1][key] for r in rs) / len(rs)
    return start, end


def _change(recs: Sequence[dict], arm: str, key: str) -> dict[int, float]:
    """Per seed, the last epoch's ``key`` minus the first's."""
    return {
        int(r["seed"]): float(r["history"][-1][key]) - float(r["history"][0][key])
        for r in recs
        if r["arm"] == arm and r.get("history") and key in r["history"][0]
    }


def judge_fig3(recs: list[dict], ctx: ClaimContext, *, baseline: float | None = None) -> ClaimResult:
    """Fig. 3, one part per layer (self, cross): per seed, SDPA's change of the mean log magnitude
    from the first epoch to the last minus the largest absolute change of the IKA arms (paper:
    SDPA's grows, IKA's stays stable; direction only), judged by the one rule and gated by the
    translation runs' sanity baseline."""
    rows = []
    figs: dict[str, Any] = {}
    parts: dict[str, Judgement] = {}
    gate = _gate("translation", recs, _TRANSLATION_ARMS, "bleu", baseline)
    lead = None
    for layer in ("self", "cross"):
        key = f"{layer}_mean_log_magnitude"
        for arm in _TRANSLATION_ARMS:
            s0, s1 = _start_end(recs, arm, f"{layer}_max_similarity")
            m0, m1 = _start_end(recs, arm, key)
            rows.append((layer, arm, f"{s0:.3f} → {s1:.3f}", f"{m0:.3f} → {m1:.3f}"))
            figs[f"{layer}:{arm}:log_magnitude_change"] = round(m1 - m0, 4)
        sd = _change(recs, "transformer", key)
        ikas = [_change(recs, a, key) for a in ("ikan-direct", "mikan")]
        seeds = sorted(set(sd).intersection(*ikas))
        eff = effect_of([sd[s] - max(abs(c[s]) for c in ikas) for s in seeds])
        parts[layer] = judge_effect(eff, gate=gate)
        lead = lead or eff
    j = combine(parts)
    table = markdown_table(
        ("layer", "arm", "max similarity start → end", "mean log magnitude start → end"), rows
    )
    return ClaimResult(
        verdict=j.verdict,
        summary=(
            f"Change of the mean log magnitude from the first to the last epoch, SDPA "
            f"(self {figs['self:transformer:log_magnitude_change']:+.3f}, cross "
            f"{figs['cross:transformer:log_magnitude_change']:+.3f}) vs IKAN-direct (self "
            f"{figs['self:ikan-direct:log_magnitude_change']:+.3f}) and MIKAN (self "
            f"{figs['self:mikan:log_magnitude_change']:+.3f}){gate_text(gate)}. "
            f"Verdict: {j.verdict} — {j.reason}."
        ),
        figures=figs,
        details=table
        + "\n\nMeans over seeds; magnitude as the mean log of exp((‖q‖_p²+‖k‖_p²)/(2√d)), every arm at "
        "the same p."
        + _scale_note(ctx, recs, "translation", f"the Table 3 runs; {P_NOTE}"),
        reason=j.reason,
        training=training_record(
            metric="self-attention log-magnitude change, SDPA - max |IKA|", higher_is_better=True,
            arms={a: list(_change(recs, a, "self_mean_log_magnitude").values()) for a in _TRANSLATION_ARMS},
            gate=gate, effect=lead),
    )


@claim(
    paper=PAPER,
    key="table4",
    title="Regression: IKAN-direct and MIKAN reach lower RMSE than SDPA",
    requires=("plots", "train"),
    reference="Table 4",
)
def table4(ctx: ClaimContext) -> ClaimResult:
    """Table 4: cross-validated RMSE of IKAN-direct / MIKAN against SDPA (trained regression)."""
    recs = records(ctx, "regression")
    result = judge_table4(recs, ctx, baselines=_baselines("regression", recs, "co2"))
    _show(ctx, "regression", "learning_curves.png")
    return result


# the paper's Table 4 column beside each data set (as the task's paper_results): CO2 is the
# paper's own series; sunspots stands beside its other series (Passenger); diabetes has none
_PAPER_REGRESSION_COLUMN = {"co2": "CO2", "sunspots": "Passenger"}
_REGRESSION_ARMS = ("transformer", "ikan-direct", "mikan")


def judge_table4(
    recs: list[dict], ctx: ClaimContext, *, baselines: Mapping[str, float] | None = None
) -> ClaimResult:
    """Table 4 per data set: each IKA arm vs SDPA in RMSE, paired per fold (the paper's relative
    improvement applied to our SDPA RMSE: its targets are normalized otherwise), gated by ridge
    regression on the same folds (``baselines``: data set -> RMSE)."""
    from attnopt.experiments.ika_regression import PAPER as P4

    def judge(ds: str, sub: list[dict]) -> Judged:
        b = (baselines or {}).get(ds)
        return judge_ranking(
            sub,
            metric="rmse",
            higher=False,
            baseline="transformer",
            fixed=(),
            ika=("ikan-direct", "mikan"),
            paper=P4[_PAPER_REGRESSION_COLUMN[ds]] if ds in _PAPER_REGRESSION_COLUMN else None,
            gate=_gate("regression", sub, _REGRESSION_ARMS, "rmse", b, higher=False),
            relative=True,
        )

    def detail(ds: str, sub: list[dict], table: str) -> str:  # noqa: ARG001
        column = _PAPER_REGRESSION_COLUMN.get(ds)
        source = (
            f"paper column: {column}" if column else "no paper column: the paper has no counterpart data set"
        )
        return f"**{ds}** (CV folds; RMSE of the standardized target; {source})\n\n{table}"

    what = f"a Transformer encoder regressor, cross-validated; {P_NOTE}"
    return _by_dataset(ctx, recs, "regression", "co2", judge, detail, what)


@claim(
    paper=PAPER,
    key="fig4",
    title="Trained MIKAN: attention weights get sparser as p → 0; every p beats SDPA",
    requires=("plots", "train"),
    reference="Fig. 4a-c",
)
def fig4(ctx: ClaimContext) -> ClaimResult:
    """Fig. 4: trained MIKAN's attention weights get sparser as p decreases (a-b) and every p's
    RMSE is below SDPA's (c) (the Table 4 runs)."""
    from attnopt.claims._sanity import baseline

    recs = records(ctx, "regression")
    result = judge_fig4(recs, ctx, baseline=baseline("regression", recs))
    _show(ctx, "regression", "fig4_mikan_p.png")
    return result


def judge_fig4(recs: list[dict], ctx: ClaimContext, *, baseline: float | None = None) -> ClaimResult:
    """Fig. 4, judged by the one rule over folds. *4a-b*: the per-fold mean max attention weight
    at the smallest p minus at the largest p (paper: weights go to 0 or 1 as p → 0; direction
    only). *4c*: per p, the paired per-fold RMSE improvement of MIKAN over SDPA (paper: "all
    results show better performance than the baselines"; direction only), gated by ridge."""
    from attnopt.experiments.ika_regression import arm_p

    by_p: dict[float, str] = {}
    for r in recs:
        if r["arm"] == "mikan" or r["arm"].startswith("mikan-p"):
            p = arm_p(r["arm"])
            if p is not None:
                by_p[p] = r["arm"]
    ps = sorted(by_p)
    if len(ps) < 2:
        why = "fewer than two values of p were trained"
        return ClaimResult(verdict="inconclusive", summary=why, reason=why)
    stats = {p: arm_stats(recs, by_p[p], "mean_max_weight") for p in ps}
    rmse = {p: arm_stats(recs, by_p[p], "rmse") for p in ps}
    means = [stats[p][0] for p in ps]
    monotone = all(a > b for a, b in zip(means, means[1:]))  # p ascending: max weight descending
    parts: dict[str, Judgement] = {}
    sparse = effect_of(paired_diffs(recs, by_p[ps[0]], by_p[ps[-1]], "mean_max_weight"))
    parts["4a-b sparser as p → 0"] = judge_effect(sparse)
    gate = _gate("regression", recs, ("transformer", *by_p.values()), "rmse", baseline, higher=False)
    has_sdpa = any(r["arm"] == "transformer" for r in recs)
    for p in ps:
        if has_sdpa:
            parts[f"4c p={p:g} beats SDPA"] = judge_pair(
                recs, by_p[p], "transformer", "rmse", higher=False, gate=gate)[0]
    j = combine(parts)
    rows = [
        (
            f"{p:g}",
            fmt_ci(*stats[p][:2], digits=3),
            fmt_ci(*rmse[p][:2], digits=3),
            f"{arm_stats(recs, by_p[p], 'share_above_0.99')[0]:.3f}",
        )
        for p in ps
    ]
    if has_sdpa:
        rows.append(("SDPA", "—", fmt_ci(*arm_stats(recs, "transformer", "rmse")[:2], digits=3), "—"))
    return ClaimResult(
        verdict=j.verdict,
        summary=(
            f"MIKAN's mean max attention weight is {fmt_ci(*stats[ps[0]][:2], digits=3)} at p={ps[0]:g} vs "
            f"{fmt_ci(*stats[ps[-1]][:2], digits=3)} at p={ps[-1]:g} "
            f"({'monotone' if monotone else 'not monotone'} in p); RMSE per p "
            + ", ".join(f"{p:g}: {rmse[p][0]:.3f}" for p in ps)
            + (f" vs SDPA {arm_stats(recs, 'transformer', 'rmse')[0]:.3f}" if has_sdpa else "")
            + f"{gate_text(gate)}. Verdict: {j.verdict} — {j.reason}."
        ),
        figures={f"max_weight_p{p:g}": round(stats[p][0], 4) for p in ps}
        | {f"rmse_p{p:g}": round(rmse[p][0], 4) for p in ps},
        details=markdown_table(("p", "mean max weight", "RMSE", "share of weights > 0.99"), rows)
        + _scale_note(ctx, recs, "regression", f"the Table 4 runs; {P_NOTE}"),
        reason=j.reason,
        training=training_record(
            metric="mean_max_weight", higher_is_better=True,
            arms={f"p={p:g}": arm_values(recs, by_p[p], "mean_max_weight") for p in ps},
            gate=None, effect=sparse),
    )


@claim(
    paper=PAPER,
    key="table5",
    title="Node classification: kernel graph attention (IKAN-direct, MIKAN) ≥ GAT",
    requires=("plots", "train", "graph"),
    reference="Table 5",
)
def table5(ctx: ClaimContext) -> ClaimResult:
    """Table 5: kernel graph attention (IKAN-direct, MIKAN) against GAT, CV accuracy (trained)."""
    from attnopt.claims._sanity import baseline

    recs = records(ctx, "node-classification")
    result = judge_table5(recs, ctx, baseline=baseline("node-classification", recs))
    _show(ctx, "node-classification", "learning_curves.png")
    return result


_NODE_ARMS = ("gat", "ikan-direct", "mikan")


def judge_table5(recs: list[dict], ctx: ClaimContext, *, baseline: float | None = None) -> ClaimResult:
    """Table 5: each kernel graph attention vs GAT, paired per fold (the paper's Cora effect in
    points / 100), gated by logistic regression on the node features (``baseline``)."""
    from attnopt.experiments.ika_node_classification import PAPER as P5

    jd = judge_ranking(
        recs,
        metric="accuracy",
        higher=True,
        baseline="gat",
        fixed=(),
        ika=("ikan-direct", "mikan"),
        paper=P5["Cora"],
        scale=100.0,
        gate=_gate("node-classification", recs, _NODE_ARMS, "accuracy", baseline),
        paper_units=0.01,
    )
    return _single(
        jd,
        summary=f"planted-partition graph, CV accuracy %: {jd.summary}",
        figures=jd.figures,
        details=jd.table
        + "\n\nPaper column: Cora (the paper's Citeseer: GAT 72.5, IKAN-direct 72.8, MIKAN 72.9; "
        "Pubmed: 79.0, 79.2, 79.1). Ours is a planted-partition graph, not Cora."
        + _scale_note(
            ctx, recs, "node-classification", "a 2-layer graph attention network, cross-validated over nodes"
        ),
    )


@claim(
    paper=PAPER,
    key="fig5",
    title="MIKAN learns a spectral density other than GAT's Gaussian; its heads are more diverse than GAT's",
    requires=("plots", "train", "graph"),
    reference="Fig. 5a-d",
)
def fig5(ctx: ClaimContext) -> ClaimResult:
    """Fig. 5: MIKAN's spectral points vs GAT's Gaussian (a-c) and head diversity (d) (the Table 5 runs)."""
    from attnopt.claims._sanity import baseline

    recs = records(ctx, "node-classification")
    result = judge_fig5(recs, ctx, baseline=baseline("node-classification", recs))
    _show(ctx, "node-classification", "fig5abc_spectral_*.png", "fig5d_head_std.png")
    return result


def judge_fig5_spectral(recs: Sequence[dict], *, gate: Gate | None = None) -> Judged:
    """Fig. 5a–c: does MIKAN's learned spectral density differ from GAT's fixed Gaussian?

    Per run, an MMD permutation test of MIKAN's first-layer spectral points against a sample
    of ``N(0, I/2)`` (``spectral_mmd2``, ``spectral_mmd_p``; see the task). Judged by the one
    rule on the per-run unbiased MMD² (0 in expectation when the density is the Gaussian;
    direction only): reproduced when its CI lies above 0. The per-run permutation p-values are
    shown beside. IKAN-direct's learned points are shown beside.
    """
    runs = [r for r in recs if r["arm"] == "mikan" and "spectral_mmd_p" in r.get("metrics", {})]
    if not runs:
        why = "no MIKAN spectral-point test in the records"
        return Judged("inconclusive", why, {}, "", why)
    sig = sum(r["metrics"]["spectral_mmd_p"] < 0.05 for r in runs)
    st = {a: arm_stats(recs, a, "spectral_mmd2") for a in ("ikan-direct", "mikan")}
    p_runs = {
        a: sorted(r["metrics"]["spectral_mmd_p"] for r in recs
                  if r["arm"] == a and "spectral_mmd_p" in r["metrics"])
        for a in ("ikan-direct", "mikan")
    }
    off = arm_stats(recs, "mikan", "copula_max_offdiag")
    rows = [
        (a, fmt_ci(*st[a][:2], digits=4), ", ".join(f"{p:.3f}" for p in p_runs[a]), st[a][2])
        for a in st
        if st[a][2]
    ]
    head = ("arm", "MMD² vs N(0, I/2) (mean ± 95% CI)", "permutation p per run", "runs")
    table = markdown_table(head, rows)
    eff = effect_of([float(r["metrics"]["spectral_mmd2"]) for r in runs if "spectral_mmd2" in r["metrics"]])
    j = judge_effect(eff, gate=gate)
    summary = (
        f"MIKAN's first-layer spectral points differ from GAT's fixed Gaussian (MMD permutation test, 5 %) "
        f"in {sig} of {len(runs)} runs (MMD² {fmt_ci(*st['mikan'][:2], digits=4)}); its copula's largest "
        f"off-diagonal correlation {off[0]:.3f}"
    )
    figures = {
        "mikan_spectral_mmd2": round(st["mikan"][0], 5),
        "mikan_runs_differing_from_gaussian": sig,
        "mikan_runs": len(runs),
        "mikan_copula_max_offdiag": round(off[0], 4),
    }
    if st["ikan-direct"][2]:
        figures["ikan-direct_spectral_mmd2"] = round(st["ikan-direct"][0], 5)
    training = training_record(metric="spectral_mmd2", higher_is_better=True,
                               arms={"mikan": list(eff.diffs)}, gate=gate, effect=eff)
    return Judged(j.verdict, summary, figures, table, j.reason, training)


def judge_fig5(recs: list[dict], ctx: ClaimContext, *, baseline: float | None = None) -> ClaimResult:
    """Fig. 5a–c (:func:`judge_fig5_spectral`) and 5d (MIKAN's head diversity vs GAT's, paired
    per fold, direction only), combined; both gated by the node-classification baseline."""
    gate = _gate("node-classification", recs, _NODE_ARMS, "accuracy", baseline)
    st = {a: arm_stats(recs, a, "head_std") for a in ("gat", "ikan-direct", "mikan")}
    g, m = st["gat"], st["mikan"]
    j_d, eff_d = judge_pair(recs, "mikan", "gat", "head_std", gate=gate)
    abc = judge_fig5_spectral(recs, gate=gate)
    j = combine({"5a-c": Judgement(abc.verdict, abc.reason), "5d": j_d})
    rows = [(a, fmt_ci(*st[a][:2], digits=4)) for a in st]
    return ClaimResult(
        verdict=j.verdict,
        summary=(
            f"Fig. 5a-c: {abc.summary} ({abc.verdict}). Fig. 5d: std of first-layer edge weights across "
            "heads: "
            f"MIKAN {fmt_ci(*m[:2], digits=4)} vs GAT {fmt_ci(*g[:2], digits=4)} ({j_d.verdict})"
            f"{gate_text(gate)}. Verdict: {j.verdict} — {j.reason}."
        ),
        figures={f"{a}_head_std": round(st[a][0], 5) for a in st} | abc.figures,
        details="**Fig. 5a-c** (spectral points of the first layer; GAT's RBF has the fixed density "
        "N(0, I/2))\n\n"
        + abc.table
        + "\n\n**Fig. 5d**\n\n"
        + markdown_table(("arm", "head std (mean ± 95% CI)"), rows)
        + _scale_note(ctx, recs, "node-classification", "the Table 5 runs"),
        reason=j.reason,
        training=training_record(metric="head_std", higher_is_better=True,
                                 arms={a: arm_values(recs, a, "head_std") for a in ("gat", "mikan")},
                                 gate=gate, effect=eff_d),
    )
