"""``attnopt train``: listing, clear errors with exit 2, and a 2-process DDP run on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnopt.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--list"]) == 0
    out = capsys.readouterr().out
    assert "ot-vit: fenchel-dual-attention, Table 1" in out and "arms: vit, ot-vit" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "nope"], "unknown task 'nope'; valid tasks: "),
        (["train", "ot-vit", "--arms", "vit,bad"], "no arm 'bad'; valid arms: vit, ot-vit"),
        (["train", "ot-vit", "--lr", "0"], "--lr must be positive numbers"),
        (["train", "ot-vit", "--lr", "abc"], "--lr must be positive numbers"),
        (["train", "ot-vit", "--devices", "4096"], "--devices 4096"),
        (["train", "ot-vit", "--dataset", "imagenet"], "valid: digits, fashion-mnist, cifar10, cifar100"),
        (
            [
                "train",
                "ot-vit",
                "--dataset",
                "fashion-mnist",
                "--data-dir",
                "{tmp}",
                "--quick",
                "--seeds",
                "1",
                "--lr",
                "1e-3",
                "--arms",
                "vit",
            ],
            "train-images-idx3-ubyte.gz",
        ),
        (["train", "ot-vit", "--epochs", "0"], "--epochs must be a positive integer"),
        (["train"], "give a TASK"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args] + ["--out", str(tmp_path / "o"), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("error: ")


def test_missing_lightning_says_which_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a)
    )
    assert main(["train", "--list"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: attnopt train needs the 'train' extra: pip install 'attnopt[train]'"
    )


@pytest.mark.slow  # ~10–25 s: run with `pytest -m slow`
def test_ddp_two_processes_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "attnopt.cli",
        "train",
        "ot-vit",
        "--quick",
        "--arms",
        "ot-vit",
        "--seeds",
        "1",
        "--epochs",
        "2",
        "--lr",
        "3e-3",
        "--size",
        "d_model=8",
        "--size",
        "train_limit=128",
        "--devices",
        "2",
        "--strategy",
        "ddp",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("1 run in") == 1  # rank 0 reports
    recs = json.loads((tmp_path / "results.json").read_text())
    assert len(recs) == 1
    assert set(recs[0]) >= {
        "metrics",
        "history",
        "wall_time_s",
        "step_time_s",
        "n_params",
        "config",
        "finished",
    }
    assert set(recs[0]["metrics"]) == {"accuracy", "test_loss"} and len(recs[0]["history"]) == 2
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    ckpts = [f for f in files if f.endswith(".ckpt")]
    assert ckpts == [
        "runs/ot-vit/seed0-lr0.003/checkpoints/epoch=0.ckpt",
        "runs/ot-vit/seed0-lr0.003/checkpoints/epoch=1.ckpt",
    ]
    assert not [f for f in files if ".tmp" in f]
