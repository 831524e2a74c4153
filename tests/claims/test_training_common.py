"""What the trained claims share: statistics, the mean ± CI table, verdict combination, and the
scale note that names the scale that ran (full sizes in full mode), read from the records."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnopt.claims import ClaimContext, ClaimResult
from attnopt.claims._training_common import (
    arm_stats,
    combine_verdicts,
    describe_runs,
    mean_ci_or_nan,
    mean_ci_table,
    scale_note,
)

pytest.importorskip("attnopt.experiments._stats")


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hand-made configs keep the default relative out_dir: the sanity baselines' data caches
    must land in a temporary folder, not in the checkout."""
    monkeypatch.chdir(tmp_path)


def _fake_records(task_name: str, *, quick: bool, metric: str = "accuracy", **plan) -> list[dict]:
    """One hand-made record per planned run of ``task_name`` (no training), carrying its config."""
    from attnopt.experiments import get_task
    from attnopt.experiments._engine import plan_runs

    configs = plan_runs(get_task(task_name), quick=quick, **plan)
    return [
        {
            "arm": c.arm,
            "seed": c.seed,
            "fold": c.fold,
            "dataset": c.dataset,
            "metrics": {metric: 0.5 + 0.01 * i},
            "history": [],
            "config": c.to_json(),
        }
        for i, c in enumerate(configs)
    ]


def test_statistics_table_and_verdicts():
    recs = [{"arm": "a", "metrics": {"x": v}} for v in (1.0, 2.0, 3.0)] + [{"arm": "b", "metrics": {}}]
    m, h, n = arm_stats(recs, "a", "x")
    assert (m, n) == (2.0, 3) and h == pytest.approx(4.302653 / 3**0.5, rel=1e-6)  # t(0.975, 2) · s / √n
    assert all(x != x for x in mean_ci_or_nan([])) and arm_stats(recs, "b", "x")[2] == 0  # nan, no runs
    table = mean_ci_table(recs, ["a", "c"], ["x"], {"a": 9, "c": 8}, count="seeds", show_missing=True)
    assert "| a | 2.00 ± 2.48 | 3 | 9 |" in table and "| c | not run | 0 | 8 |" in table
    assert "| c |" not in mean_ci_table(recs, ["a", "c"], ["x"], None)
    assert combine_verdicts(["reproduced", "reproduced"]) == "reproduced"
    assert combine_verdicts(["reproduced", "inconclusive"]) == "partially reproduced"
    assert combine_verdicts(["reproduced", "not reproduced"]) == "partially reproduced"
    assert combine_verdicts(["not reproduced"]) == combine_verdicts(["not reproduced", "inconclusive"]) \
        == "not reproduced"
    assert combine_verdicts([]) == "inconclusive"


def test_describe_runs_counts_seeds_and_folds_and_lists_what_differs():
    cfgs = [
        {"seed": s, "fold": f, "epochs": e, "batch_size": 32, "dataset": "co2",
         "sizes": {"d_model": 64, "p": p}}
        for s in (0, 1)
        for f in range(3)
        for e, p in ((12, 2), (3, 1))
    ]
    text = describe_runs(cfgs)
    assert text.startswith("2 seeds × 3 folds, 3/12 epochs, batch size 32, data co2;")  # numeric order
    assert "d_model=64" in text and "p=1/2" in text
    assert describe_runs(cfgs[:1]).startswith("1 seed, 12 epochs")


def test_note_reads_the_records_config_before_the_plan(tmp_path: Path):
    ctx = ClaimContext(quick=True, out_dir=tmp_path)
    rec = {"arm": "a", "seed": 0, "config": {"seed": 0, "epochs": 99, "sizes": {"d_model": 7}}}
    note = scale_note(ctx, [rec], "a model", planned=lambda: [{"seed": 0, "epochs": 1}])
    assert "Scale (quick): a model; 1 seed, 99 epochs; d_model=7 (from the runs' configs)" in note
    note = scale_note(ctx, [{"arm": "a"}], "a model", planned=lambda: [{"seed": 0, "epochs": 1}])
    assert "1 seed, 1 epochs (as planned" in note


@pytest.mark.parametrize(
    ("judge", "task", "metric"),
    [
        ("judge_table2", "sentence-classification", "accuracy"),
        ("judge_table3", "translation", "bleu"),
        ("judge_table4", "regression", "rmse"),
        ("judge_table5", "node-classification", "accuracy"),
    ],
)
def test_implicit_kernel_full_mode_note_names_the_full_sizes(judge, task, metric, tmp_path: Path):
    from attnopt.claims.implicit_kernel import training as tr
    from attnopt.experiments import get_task

    full = get_task(task).full
    recs = _fake_records(task, quick=False, metric=metric, seeds=2)
    ctx = ClaimContext(quick=False, out_dir=tmp_path)
    details = getattr(tr, judge)(recs, ctx).details
    note = details[details.index("Scale (full)"):]
    assert f"{full.epochs} epochs" in note and f"batch size {full.batch_size}" in note
    assert all(f"{k}={v}" in note for k, v in full.sizes.items()), note
    assert "from the runs' configs" in note
    # records without a config: the note falls back to the plan of the context's scale
    bare = [{k: v for k, v in r.items() if k != "config"} for r in recs]
    note = getattr(tr, judge)(bare, ctx).details
    assert f"{full.epochs} epochs" in note and "as planned" in note
    quick = getattr(tr, judge)(bare, ClaimContext(quick=True, out_dir=tmp_path)).details
    assert "Scale (quick)" in quick and f"{full.epochs} epochs" not in quick


def test_doubly_normalized_full_mode_notes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from attnopt.claims import doubly_normalized_training as dn
    from attnopt.experiments import get_task

    fusion = _fake_records("multiview-fusion", quick=False, seeds=2)
    headline = _fake_records("headline", quick=False, metric="rougeL", seeds=2)
    fake = {"multiview-fusion": fusion, "headline": headline}
    monkeypatch.setattr(dn, "records", lambda ctx, task: fake[task])  # noqa: ARG005
    ctx = ClaimContext(quick=False, out_dir=tmp_path)
    full = get_task("multiview-fusion").full
    details = dn.table1(ctx).details
    assert f"2 seeds, {full.epochs} epochs" in details and f"d_model={full.sizes['d_model']}" in details
    details = dn.table2(ctx).details
    assert "pretrained_epochs=3" in details and "MiniLM-initialized rows start from" in details
    random_only = [r for r in headline if r["arm"].endswith("-random")]
    monkeypatch.setitem(fake, "headline", random_only)
    assert "MiniLM-initialized rows did not run" in dn.table2(ctx).details


def test_ot_vit_full_mode_note(tmp_path: Path):
    from attnopt.claims.fenchel_dual import ot_vit
    from attnopt.experiments import get_task

    full = get_task("ot-vit").full
    ctx = ClaimContext(quick=False, out_dir=tmp_path)
    recs = _fake_records("ot-vit", quick=False)
    details = ot_vit._with_scale(ctx, recs, ClaimResult("reproduced", "s")).details
    assert f"{full.seeds} seeds, {full.epochs} epochs" in details and "num_layers=4" in details


def test_every_doubly_normalized_claim_ends_with_its_scale_note(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    from attnopt.claims import doubly_normalized_training as dn
    from tests.claims.test_training_judges_golden import _DN_ARMS, _records

    recs = _records(_DN_ARMS, seed=1, sign=1.0)
    monkeypatch.setattr(dn, "records", lambda ctx, task: recs)  # noqa: ARG005
    for key in ("table1", "fig3", "fig1_training", "table2", "table3", "fig4"):
        ctx = ClaimContext(quick=True, out_dir=tmp_path, prefix=key)
        res = getattr(dn, key)(ctx)
        assert "Scale (quick)" in res.details
        assert res.details.endswith("see the task's docstring for the stand-in.")
        judge = dn.__dict__[f"judge_{key.removesuffix('_training')}"]
        # Fig. 4 is gated by the pretraining runs' downstream gates (dn.pretraining_gate)
        want = judge(recs, gate=dn.pretraining_gate(recs)) if key == "fig4" else judge(recs)
        assert res.verdict == want.verdict
        if key.startswith("fig"):
            assert len(ctx.images) == 1 and ctx.images[0].is_file()  # the figure joins the claim
