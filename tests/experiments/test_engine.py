"""The engine: one Lightning fit per run, results files, resume skipping, plan validation."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from attnopt.experiments._engine import plan_runs, run_task
from attnopt.experiments._stats import mean_ci
from tests.experiments._tiny import TASK


def test_run_task_fits_and_writes_results(tmp_path: Path) -> None:
    recs = run_task(TASK, arms=["softmax"], seeds=2, epochs=2, out_dir=tmp_path, progress=False)
    assert [(r["arm"], r["seed"]) for r in recs] == [("softmax", 0), ("softmax", 1)]
    for r in recs:
        assert set(r) >= {
            "task",
            "arm",
            "seed",
            "lr",
            "fold",
            "dataset",
            "metrics",
            "history",
            "wall_time_s",
            "step_time_s",
            "n_params",
            "config",
            "finished",
        }
        assert [h["epoch"] for h in r["history"]] == [0, 1]
        assert r["history"][1]["train_loss"] < r["history"][0]["train_loss"]
        assert 0.0 <= r["metrics"]["accuracy"] <= 1.0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["metrics"] for s in saved] == [r["metrics"] for r in recs]
    assert recs[0]["metrics"] != recs[1]["metrics"] or recs[0]["history"] != recs[1]["history"]
    md = (tmp_path / "results.md").read_text()
    assert "| softmax | 0.01 |" in md and "0.9" in md
    assert (tmp_path / "figures" / "learning_curves.png").is_file()
    ckpts = sorted(p.name for p in (tmp_path / "runs/softmax/seed0-lr0.01/checkpoints").iterdir())
    assert ckpts == ["epoch=0.ckpt", "epoch=1.ckpt"]
    # same seed again -> same numbers; --resume skips finished runs (keeps their records)
    again = run_task(
        TASK,
        arms=["softmax"],
        seeds=[0],
        epochs=2,
        out_dir=tmp_path / "b",
        progress=False,
        write_report=False,
    )
    assert again[0]["metrics"] == recs[0]["metrics"] and again[0]["history"] == recs[0]["history"]
    skipped = run_task(
        TASK,
        arms=["softmax"],
        seeds=2,
        epochs=2,
        out_dir=tmp_path,
        progress=False,
        resume=True,
        write_report=False,
    )
    assert [r["wall_time_s"] for r in skipped] == [r["wall_time_s"] for r in recs]


def test_checkpoints_kept_during_and_after_a_run(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_task(TASK, arms=["softmax"], seeds=[0], epochs=3, out_dir=tmp_path / "a", progress=False,
                 write_report=False)
    assert not [w for w in caught if "LeafSpec" in str(w.message)]  # Lightning's noise stays quiet
    ckpt = tmp_path / "a/runs/softmax/seed0-lr0.01/checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=1.ckpt", "epoch=2.ckpt"]  # newest two
    recs = run_task(TASK, arms=["softmax"], seeds=[0], epochs=3, out_dir=tmp_path / "b", progress=False,
                    write_report=False, keep_checkpoints=0)
    assert not list((tmp_path / "b/runs/softmax/seed0-lr0.01/checkpoints").glob("*.ckpt"))
    again = run_task(TASK, arms=["softmax"], seeds=[0], epochs=3, out_dir=tmp_path / "b", progress=False,
                     write_report=False, resume=True)  # finished: known by its record, not retrained
    assert again[0]["wall_time_s"] == recs[0]["wall_time_s"]
    with pytest.raises(ValueError, match="keep_checkpoints"):
        run_task(TASK, arms=["softmax"], seeds=[0], out_dir=tmp_path / "c", keep_checkpoints=-1)


def test_plan_validates() -> None:
    runs = plan_runs(TASK, quick=True, lrs=[1e-3, 3e-3])
    assert len(runs) == 2 * 2 * 2 and {r.arm for r in runs} == {"softmax", "dnas"}
    with pytest.raises(ValueError, match="valid arms: softmax, dnas, ikan"):
        plan_runs(TASK, arms=["nope"])
    with pytest.raises(ValueError, match="positive number"):
        plan_runs(TASK, lrs=[-1.0])
    with pytest.raises(ValueError, match="valid: blobs"):
        plan_runs(TASK, dataset="cifar10")
    with pytest.raises(ValueError, match="positive integer"):
        plan_runs(TASK, epochs=0)


def test_mean_ci() -> None:
    assert mean_ci([0.5]) == (0.5, 0.0)
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.302652729911275 * 1.0 / 3**0.5)
    with pytest.raises(ValueError):
        mean_ci([])
