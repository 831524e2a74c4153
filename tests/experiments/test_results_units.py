"""results.md: one unit per metric (the paper's, beside the paper's numbers); no fake CI for one run."""

from __future__ import annotations

from pathlib import Path

from attnopt.claims._training_common import fmt_ci
from attnopt.experiments import get_task
from attnopt.experiments._results import write_results_md
from attnopt.experiments._stats import format_ci


def _rec(arm: str, seed: int, acc: float) -> dict:
    return {"arm": arm, "seed": seed, "lr": 1e-3, "dataset": "docstring-module", "metrics": {"accuracy": acc},
            "step_time_s": 0.01, "n_params": 10, "config": {"quick": True, "epochs": 2}}


def test_fraction_accuracy_is_shown_in_the_papers_percent(tmp_path: Path) -> None:
    task = get_task("sentence-classification")
    assert task.metric_unit == "%" and task.metric_scale == 100.0
    md = write_results_md(task, [_rec("transformer", 0, 0.8125)], tmp_path / "r.md").read_text()
    assert "accuracy (%, mean ± 95 % CI)" in md and "paper (%)" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| transformer |"))
    assert "| 81.25 ± — | 1 | 84.12 |" in row  # measured and paper in the same unit; one run: no CI
    md = write_results_md(task, [_rec("transformer", 0, 0.80), _rec("transformer", 1, 0.82)],
                          tmp_path / "r2.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| transformer |"))
    assert "| 81.00 ± " in row and "—" not in row.split("|")[3]


def test_every_accuracy_is_shown_in_percent_beside_the_papers_percent() -> None:
    for name in ("multiview-fusion", "node-classification", "sentence-classification", "pretrain-finetune",
                 "ot-vit"):
        task = get_task(name)
        assert task.metric_unit == "%", name
        paper = [v * task.paper_scale for tab in task.paper_results.values() for v in tab.values()]
        assert paper and all(1 < v <= 100 for v in paper), name


def test_a_fraction_paper_is_converted_too(tmp_path: Path) -> None:
    task = get_task("ot-vit")
    rec = {**_rec("vit", 0, 0.9), "dataset": "fashion-mnist"}
    md = write_results_md(task, [rec], tmp_path / "r.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| vit |"))
    assert "| 90.00 ± — | 1 | 92.8 |" in row


def test_one_run_has_no_interval() -> None:
    assert format_ci([0.5]) == "0.500 ± — (n=1)"
    assert format_ci([0.5, 0.5]) == "0.500 ± 0.000 (n=2)"
    assert fmt_ci(0.5, 0.0, n=1, scale=100.0) == "50.00 ± —"
    assert fmt_ci(0.5, 0.01, n=3, scale=100.0) == "50.00 ± 1.00"
