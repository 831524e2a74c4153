"""kill -9 of a real training process, then --resume: the same results as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from attnopt.experiments._engine import latest_checkpoint, run_task
from tests.experiments._tiny import TASK

ROOT = Path(__file__).resolve().parents[2]
OPTS = {"arms": ["ikan"], "seeds": [3], "epochs": 5, "sizes": {"n": 160}}  # dropout + sampled spectral points


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow  # ~10–25 s: run with `pytest -m slow`
def test_kill_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "tests.experiments._tiny", str(out), json.dumps(OPTS)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = out / "runs/ikan/seed3-lr0.01/checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpt / "epoch=1.ckpt").exists() and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "results.json").exists()
    resumed = subprocess.run(
        [*cmd[:-1], json.dumps({**OPTS, "resume": True})],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = json.loads((out / "results.json").read_text())[0]
    assert got["resumed_from"] is not None
    want = run_task(TASK, out_dir=tmp_path / "clean", progress=False, write_report=False, **OPTS)[0]
    assert got["metrics"] == want["metrics"]
    assert got["history"] == want["history"]
    # the metrics log keeps the epochs before the kill (Lightning's CSV writer alone drops them)
    import csv

    with open(out / "runs/ikan/seed3-lr0.01/logs/metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("train_loss")]
    assert [int(float(r["epoch"])) for r in rows] == list(range(OPTS["epochs"]))
    assert [float(r["train_loss"]) for r in rows] == pytest.approx([h["train_loss"] for h in want["history"]])


def test_truncated_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    run_task(
        TASK, arms=["softmax"], seeds=[0], epochs=2, out_dir=tmp_path, progress=False, write_report=False
    )
    ckpt = tmp_path / "runs/softmax/seed0-lr0.01/checkpoints"
    newest = ckpt / "epoch=1.ckpt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert latest_checkpoint(ckpt) == ckpt / "epoch=0.ckpt"
    assert any("unreadable" in str(x.message) for x in w)
    state = torch.load(ckpt / "epoch=0.ckpt", weights_only=True)  # no pickled code needed
    assert "attnopt" in state and len(state["attnopt"]["history"]) == 1
    (tmp_path / "runs/softmax/seed0-lr0.01/record.json").unlink()
    with pytest.warns(UserWarning, match="unreadable"):
        rec = run_task(
            TASK,
            arms=["softmax"],
            seeds=[0],
            epochs=2,
            out_dir=tmp_path,
            progress=False,
            resume=True,
            write_report=False,
        )[0]
    assert rec["resumed_from"] == "epoch=0.ckpt" and [h["epoch"] for h in rec["history"]] == [0, 1]
