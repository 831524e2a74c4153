r"""implicit-kernel-attention Tables 2–5 and Figs. 3–5: trained models, reduced scale.

Each claim runs a task of :mod:`attnopt.experiments` (``ika_*``) through the training engine
(quick: tiny models, few epochs, 3 seeds or 3 folds; full: the task's full scale) and judges
the records it returns. Measure (:func:`records`) and judge (``judge_*``) are separate
functions, so negative controls can mutate either cheaply. Runs shared by two claims (Table 3
and Fig. 3, Table 4 and Fig. 4, Table 5 and Fig. 5) are made once per process and output
directory.

Verdicts compare means over seeds/folds with their 95 % CI (Student t). The paper's
direction: an IKA variant beats SDPA and the fixed kernels (Tables 2–5); SDPA's magnitude
term grows during training while the IKA arms' stays stable (Fig. 3); MIKAN's weights get
sparser as ``p → 0`` (Fig. 4); MIKAN's spectral points differ from GAT's fixed Gaussian (an
MMD test, Fig. 5a–c) and its heads differ more than GAT's (Fig. 5d).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from attnopt.claims import ClaimContext, ClaimResult, Verdict, claim, verdict
from attnopt.claims._training_common import (
    arm_stats,
    combine_verdicts,
    fmt_ci,
    mean_ci_table,
    planned_configs,
    run_records,
    scale_note,
)
from attnopt.report import markdown_table

PAPER = "implicit_kernel"
_CACHE: dict[tuple[Any, ...], list[dict]] = {}

#: what a judge returns: (verdict, summary, figures, Markdown table)
Judged = tuple[Verdict, str, dict[str, Any], str]


class QuickPlan(TypedDict):
    """What a claim trains of one task in quick mode.

    Attributes:
        arms: the arms trained; dataset: the data set (``None``: the task's default); sizes: the
            task's size knobs; folds: cross-validation folds (``None``: the task's own split).
    """

    arms: tuple[str, ...]
    dataset: str | None
    sizes: dict[str, int]
    folds: int | None


# What each claim trains in quick mode (full mode: the task's own full scale and arms).
QUICK: dict[str, QuickPlan] = {
    "sentence-classification": {
        "arms": ("transformer", "rbf-only", "expsin", "linear", "ikan", "mikan"),
        "dataset": "docstring-module",
        "sizes": {"max_len": 16},
        "folds": None,
    },
    "translation": {
        "arms": ("transformer", "ikan-direct", "mikan"),
        "dataset": None,
        "sizes": {},
        "folds": None,
    },
    "regression": {
        "arms": ("transformer", "ikan-direct", "mikan", "mikan-p0.25", "mikan-p2"),
        "dataset": "co2",
        "sizes": {"folds": 3},
        "folds": 3,
    },
    "node-classification": {
        "arms": ("gat", "ikan-direct", "mikan"),
        "dataset": "sbm",
        "sizes": {"folds": 3},
        "folds": 3,
    },
}
FULL_ARMS = {"regression": ("transformer", "ikan-direct", "mikan", "mikan-p0.25", "mikan-p0.5", "mikan-p2")}


def _show(ctx: ClaimContext, task: str, *patterns: str) -> None:
    """Link the task's figures (written by the engine under ``train/<task>/figures``) in the report."""
    ctx.attach_figures(Path(ctx.out_dir) / "train" / task / "figures", *patterns)


def _run_args(ctx: ClaimContext, task: str) -> tuple[Any, dict[str, Any]]:
    """The task object and the :func:`~attnopt.experiments._engine.run_task` keywords of the
    claim's runs at the context's scale (:func:`records` runs them, the scale note plans them)."""
    import copy

    from attnopt.experiments import get_task

    plan = QUICK[task]
    the_task = get_task(task)
    kwargs: dict[str, Any] = {
        "quick": ctx.quick,
        "out_dir": Path(ctx.out_dir) / "train" / task,
    }
    if ctx.quick:
        sizes = dict(plan["sizes"])
        folds = plan["folds"]
        if folds:
            the_task = copy.copy(the_task)
            the_task.folds = folds
            sizes["folds"] = folds
        kwargs.update(arms=list(plan["arms"]), sizes=sizes or None)
        if plan["dataset"]:
            kwargs["dataset"] = plan["dataset"]
    elif task in FULL_ARMS:
        kwargs["arms"] = list(FULL_ARMS[task])
    return the_task, kwargs


def records(ctx: ClaimContext, task: str) -> list[dict]:
    """The engine's records of ``task`` at the context's scale (cached per process and out_dir).

    Quick mode trains the arms, data set and sizes of :data:`QUICK`; a plan with ``folds``
    runs that many cross-validation folds (a copy of the task with ``folds`` set, and the
    data builder told the same through ``sizes``).
    """
    return run_records(_CACHE, ctx, task, _run_args)


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
) -> Judged:
    """Do the IKA arms beat SDPA (``baseline``) and the fixed kernels? (verdict, summary, figures, table).

    Reproduced: every IKA arm's mean is better than the baseline's and every fixed kernel's,
    and the best IKA arm is ahead of the best reference beyond the two 95 % CIs (a difference
    inside the CIs is not evidence at this number of seeds/folds). Partially: the best IKA
    arm's mean is strictly better than the baseline's and the best fixed kernel's. Not
    reproduced otherwise.
    """
    sign = 1.0 if higher else -1.0
    stats = {a: arm_stats(recs, a, metric) for a in (baseline, *fixed, *ika)}
    present = {a: s for a, s in stats.items() if s[2] > 0}
    ika_p = [a for a in ika if a in present]
    fixed_p = [a for a in fixed if a in present]
    if baseline not in present or not ika_p:
        return "not reproduced", f"no records for {baseline} or the IKA arms", {}, ""
    base_m, base_h, _ = present[baseline]
    refs = [(baseline, base_m, base_h)] + [(a, *present[a][:2]) for a in fixed_p]
    best_ref = max(refs, key=lambda t: sign * t[1])
    best_ika = max(ika_p, key=lambda a: sign * present[a][0])
    bi_m, bi_h, _ = present[best_ika]
    all_better = all(sign * (present[a][0] - r[1]) > 0 for a in ika_p for r in refs)
    best_better = sign * (bi_m - best_ref[1]) > 0
    separated = sign * (bi_m - best_ref[1]) > bi_h + best_ref[2]
    v = verdict(all_better and separated, partial=best_better)
    table = mean_ci_table(recs, (baseline, *fixed_p, *ika_p), [metric], paper, digits=3, scale=scale)
    summary = (
        f"best IKA arm {best_ika} {metric} {fmt_ci(bi_m, bi_h, digits=3, scale=scale)} vs best of "
        f"SDPA/fixed kernels {best_ref[0]} {fmt_ci(best_ref[1], best_ref[2], digits=3, scale=scale)}: "
        f"{'better' if best_better else 'not better'}"
        f"{' beyond the CIs' if separated else (' within the CIs' if best_better else '')}; "
        f"{'every' if all_better else 'not every'} IKA arm beats SDPA and every fixed kernel"
    )
    figures = {f"{a}_{metric}": round(present[a][0] * scale, 4) for a in (baseline, *fixed_p, *ika_p)}
    figures["separated_beyond_ci"] = bool(separated)
    return v, summary, figures, table


def _scale_note(ctx: ClaimContext, recs: Sequence[dict], task: str, what: str) -> str:
    """The scale the records of ``task`` ran at (:func:`~attnopt.claims._training_common.scale_note`)."""
    return scale_note(ctx, recs, what, planned=lambda: planned_configs(ctx, task, _run_args))


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
    result = judge_table2(recs, ctx)
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
    """Judge each data set's records apart (``judge(ds, records)`` -> verdict, summary, figures,
    table; records without a data set belong to ``default``) and combine them: the verdicts by
    :func:`combine_verdicts`, the summaries joined, the figures prefixed ``"<ds>:"``, the details
    the paragraphs ``detail(ds, records, table)`` and the scale note of ``task`` (``what``)."""
    verdicts: list[Verdict] = []
    parts, figs, details = [], {}, []
    for ds in sorted({r.get("dataset") or default for r in recs}):
        sub = [r for r in recs if (r.get("dataset") or default) == ds]
        v, s, f, t = judge(ds, sub)
        verdicts.append(v)
        parts.append(f"{ds}: {s}")
        figs.update({f"{ds}:{k}": val for k, val in f.items()})
        details.append(detail(ds, sub, t))
    return ClaimResult(
        verdict=combine_verdicts(verdicts),
        summary="; ".join(parts),
        figures=figs,
        details="\n\n".join(details) + _scale_note(ctx, recs, task, what),
    )


def judge_table2(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    from attnopt.experiments.ika_sentence_classification import PAPER as P2
    from attnopt.experiments.ika_sentence_classification import PAPER_PARAMS_M as P2_PARAMS

    def judge(ds: str, sub: list[dict]) -> Judged:
        return judge_ranking(
            sub,
            metric="accuracy",
            higher=True,
            baseline="transformer",
            fixed=("rbf-only", "expsin", "linear"),
            ika=("ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"),
            paper=P2[_PAPER_TEXT_COLUMN.get(ds, "TREC")],
            scale=100.0,
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


@claim(
    paper=PAPER,
    key="table3",
    title="Translation: IKAN-direct and MIKAN reach higher BLEU than SDPA",
    requires=("plots", "train"),
    reference="Table 3",
)
def table3(ctx: ClaimContext) -> ClaimResult:
    """Table 3: BLEU of IKAN-direct / MIKAN against SDPA on German→English number words (trained)."""
    result = judge_table3(records(ctx, "translation"), ctx)
    _show(ctx, "translation", "learning_curves.png")
    return result


def judge_table3(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    v, s, f, t = judge_ranking(
        recs,
        metric="bleu",
        higher=True,
        baseline="transformer",
        fixed=(),
        ika=("ikan-direct", "mikan"),
        paper=dict.fromkeys(("transformer", "ikan-direct", "mikan"), "n/a"),
    )
    exact = {a: arm_stats(recs, a, "exact_match")[0] for a in ("transformer", "ikan-direct", "mikan")}
    return ClaimResult(
        verdict=v,
        summary=f"German→English number words, sacrebleu BLEU: {s}",
        figures={**f, **{f"{a}_exact_match": round(x, 4) for a, x in exact.items()}},
        details=t
        + "\n\nPaper column: the paper's Table 3 (IWSLT14 De-En BLEU, three runs) survives in our copy "
        "of the paper only as its caption; its numbers are not in the extracted text nor in any source "
        "we could read offline, so none are shown rather than guessed. The paper's claim is the ranking: "
        "IKAN-direct and MIKAN above Transformer."
        + _scale_note(
            ctx, recs, "translation", "a Transformer encoder-decoder, German→English number words, greedy"
            " decoding",
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
    result = judge_fig3(records(ctx, "translation"), ctx)
    _show(ctx, "translation", "fig3_similarity_magnitude.png")
    return result


def _start_end(recs: Sequence[dict], arm: str, key: str) -> tuple[float, float]:
    rs = [r for r in recs if r["arm"] == arm and r.get("history") and key in r["history"][0]]
    if not rs:
        return math.nan, math.nan
    start = sum(r["history"][0][key] for r in rs) / len(rs)
    end = sum(r["history"][-1][key] for r in rs) / len(rs)
    return start, end


def judge_fig3(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    rows, grows, stable = [], [], []
    figs: dict[str, Any] = {}
    for layer in ("self", "cross"):
        d = {}
        for arm in ("transformer", "ikan-direct", "mikan"):
            s0, s1 = _start_end(recs, arm, f"{layer}_max_similarity")
            m0, m1 = _start_end(recs, arm, f"{layer}_mean_log_magnitude")
            d[arm] = m1 - m0
            rows.append((layer, arm, f"{s0:.3f} → {s1:.3f}", f"{m0:.3f} → {m1:.3f}"))
            figs[f"{layer}:{arm}:log_magnitude_change"] = round(m1 - m0, 4)
        grows.append(d["transformer"] > 0)
        stable.append(all(abs(d[a]) < abs(d["transformer"]) for a in ("ikan-direct", "mikan")))
    ok = all(grows) and all(stable)
    partial = any(grows) or any(stable)
    table = markdown_table(
        ("layer", "arm", "max similarity start → end", "mean log magnitude start → end"), rows
    )
    return ClaimResult(
        verdict=verdict(ok, partial=partial),
        summary=(
            f"SDPA's mean log magnitude {'grows' if all(grows) else 'does not grow in every layer'} "
            f"from the first to the last epoch (self: {figs['self:transformer:log_magnitude_change']:+.3f}, "
            f"cross: {figs['cross:transformer:log_magnitude_change']:+.3f}); the IKA arms' change is "
            f"{'smaller in both layers' if all(stable) else 'not smaller in every layer'}"
        ),
        figures=figs,
        details=table
        + "\n\nMeans over seeds; magnitude as the mean log of exp((‖q‖_p²+‖k‖_p²)/(2√d))."
        + _scale_note(ctx, recs, "translation", "the Table 3 runs"),
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
    result = judge_table4(records(ctx, "regression"), ctx)
    _show(ctx, "regression", "learning_curves.png")
    return result


# the paper's Table 4 column beside each data set (as the task's paper_results): CO2 is the
# paper's own series; sunspots stands beside its other series (Passenger); diabetes has none
_PAPER_REGRESSION_COLUMN = {"co2": "CO2", "sunspots": "Passenger"}


def judge_table4(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    from attnopt.experiments.ika_regression import PAPER as P4

    def judge(ds: str, sub: list[dict]) -> Judged:
        return judge_ranking(
            sub,
            metric="rmse",
            higher=False,
            baseline="transformer",
            fixed=(),
            ika=("ikan-direct", "mikan"),
            paper=P4[_PAPER_REGRESSION_COLUMN[ds]] if ds in _PAPER_REGRESSION_COLUMN else None,
        )

    def detail(ds: str, sub: list[dict], table: str) -> str:  # noqa: ARG001
        column = _PAPER_REGRESSION_COLUMN.get(ds)
        source = (
            f"paper column: {column}" if column else "no paper column: the paper has no counterpart data set"
        )
        return f"**{ds}** (CV folds; RMSE of the standardized target; {source})\n\n{table}"

    what = "a Transformer encoder regressor, cross-validated"
    return _by_dataset(ctx, recs, "regression", "co2", judge, detail, what)


@claim(
    paper=PAPER,
    key="fig4",
    title="Trained MIKAN: attention weights get sparser as p → 0",
    requires=("plots", "train"),
    reference="Fig. 4a-c",
)
def fig4(ctx: ClaimContext) -> ClaimResult:
    """Fig. 4: trained MIKAN's attention weights get sparser as p decreases (the Table 4 runs)."""
    result = judge_fig4(records(ctx, "regression"), ctx)
    _show(ctx, "regression", "fig4_mikan_p.png")
    return result


def judge_fig4(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    from attnopt.experiments.ika_regression import arm_p

    by_p: dict[float, str] = {}
    for r in recs:
        if r["arm"] == "mikan" or r["arm"].startswith("mikan-p"):
            p = arm_p(r["arm"])
            if p is not None:
                by_p[p] = r["arm"]
    ps = sorted(by_p)
    if len(ps) < 2:
        return ClaimResult(verdict="not reproduced", summary="fewer than two values of p were trained")
    stats = {p: arm_stats(recs, by_p[p], "mean_max_weight") for p in ps}
    rmse = {p: arm_stats(recs, by_p[p], "rmse") for p in ps}
    means = [stats[p][0] for p in ps]
    monotone = all(a > b for a, b in zip(means, means[1:]))  # p ascending: max weight descending
    ends = means[0] > means[-1]
    separated = means[0] - means[-1] > stats[ps[0]][1] + stats[ps[-1]][1]
    rows = [
        (
            f"{p:g}",
            fmt_ci(*stats[p][:2], digits=3),
            fmt_ci(*rmse[p][:2], digits=3),
            f"{arm_stats(recs, by_p[p], 'share_above_0.99')[0]:.3f}",
        )
        for p in ps
    ]
    return ClaimResult(
        verdict=verdict(monotone and separated, partial=ends),
        summary=(
            f"MIKAN's mean max attention weight is {fmt_ci(*stats[ps[0]][:2], digits=3)} at p={ps[0]:g} vs "
            f"{fmt_ci(*stats[ps[-1]][:2], digits=3)} at p={ps[-1]:g} "
            f"({'monotone' if monotone else 'not monotone'} in p, "
            f"{'beyond' if separated else 'within'} the CIs)"
        ),
        figures={f"max_weight_p{p:g}": round(stats[p][0], 4) for p in ps}
        | {f"rmse_p{p:g}": round(rmse[p][0], 4) for p in ps},
        details=markdown_table(("p", "mean max weight", "RMSE", "share of weights > 0.99"), rows)
        + _scale_note(ctx, recs, "regression", "the Table 4 runs"),
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
    result = judge_table5(records(ctx, "node-classification"), ctx)
    _show(ctx, "node-classification", "learning_curves.png")
    return result


def judge_table5(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    from attnopt.experiments.ika_node_classification import PAPER as P5

    v, s, f, t = judge_ranking(
        recs,
        metric="accuracy",
        higher=True,
        baseline="gat",
        fixed=(),
        ika=("ikan-direct", "mikan"),
        paper=P5["Cora"],
        scale=100.0,
    )
    return ClaimResult(
        verdict=v,
        summary=f"planted-partition graph, CV accuracy %: {s}",
        figures=f,
        details=t
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
    result = judge_fig5(records(ctx, "node-classification"), ctx)
    _show(ctx, "node-classification", "fig5abc_spectral_*.png", "fig5d_head_std.png")
    return result


def judge_fig5_spectral(recs: Sequence[dict]) -> Judged:
    """Fig. 5a–c: does MIKAN's learned spectral density differ from GAT's fixed Gaussian?

    Per run, an MMD permutation test of MIKAN's first-layer spectral points against a sample
    of ``N(0, I/2)`` (``spectral_mmd2``, ``spectral_mmd_p``; see the task). Reproduced: every
    MIKAN run differs at the 5 % level; partially: some run does; not reproduced: none does
    (under the null each run has a 5 % chance). IKAN-direct's learned points are shown beside.
    """
    runs = [r for r in recs if r["arm"] == "mikan" and "spectral_mmd_p" in r.get("metrics", {})]
    if not runs:
        return "not reproduced", "no MIKAN spectral-point test in the records", {}, ""
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
    return verdict(sig == len(runs), partial=sig > 0), summary, figures, table


def judge_fig5(recs: list[dict], ctx: ClaimContext) -> ClaimResult:
    """Fig. 5a–c (:func:`judge_fig5_spectral`) and 5d (MIKAN's heads vs GAT's), combined."""
    st = {a: arm_stats(recs, a, "head_std") for a in ("gat", "ikan-direct", "mikan")}
    g, m = st["gat"], st["mikan"]
    more = m[0] > g[0]
    separated = m[0] - g[0] > m[1] + g[1]
    v_d = verdict(more and separated, partial=more)
    v_abc, s_abc, f_abc, t_abc = judge_fig5_spectral(recs)
    rows = [(a, fmt_ci(*st[a][:2], digits=4)) for a in st]
    return ClaimResult(
        verdict=combine_verdicts([v_abc, v_d]),
        summary=(
            f"Fig. 5a-c: {s_abc} ({v_abc}). Fig. 5d: std of first-layer edge weights across heads: "
            f"MIKAN {fmt_ci(*m[:2], digits=4)} vs GAT {fmt_ci(*g[:2], digits=4)} "
            f"({'larger' if more else 'not larger'}, {'beyond' if separated else 'within'} the CIs; {v_d})"
        ),
        figures={f"{a}_head_std": round(st[a][0], 5) for a in st} | f_abc,
        details="**Fig. 5a-c** (spectral points of the first layer; GAT's RBF has the fixed density "
        "N(0, I/2))\n\n"
        + t_abc
        + "\n\n**Fig. 5d**\n\n"
        + markdown_table(("arm", "head std (mean ± 95% CI)"), rows)
        + _scale_note(ctx, recs, "node-classification", "the Table 5 runs"),
    )
