"""``attnopt train`` for a new user: quiet Lightning, labelled runs, refusal to clobber,
Ctrl-C -> exit 130 and a working ``--resume`` (the metrics log kept whole), ``--size`` checked."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

import attnopt.experiments as experiments
from attnopt.cli import main
from tests.experiments._tiny import TinyTask


class _StopAtEpoch(TinyTask):
    """The tiny task, with Ctrl-C pressed during epoch ``stop_at`` (once)."""

    stop_at: int | None = None

    def training_loss(self, model: Any, batch: Any, cfg: Any) -> torch.Tensor:
        if self.stop_at is not None and self._epoch(model) == self.stop_at:
            self.stop_at = None
            raise KeyboardInterrupt
        return super().training_loss(model, batch, cfg)

    @staticmethod
    def _epoch(model: Any) -> int:
        return int(getattr(model, "_attnopt_epoch", 0))


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> _StopAtEpoch:
    task = _StopAtEpoch()
    real = experiments.get_task
    monkeypatch.setattr(experiments, "get_task", lambda name: task if name == "tiny" else real(name))
    from attnopt.experiments import _engine

    orig = _engine._TaskModule.on_train_epoch_start

    def mark(self: Any) -> None:  # tell the task which epoch runs
        self.model._attnopt_epoch = int(self.current_epoch)
        orig(self)

    monkeypatch.setattr(_engine._TaskModule, "on_train_epoch_start", mark)
    return task


def _rows(out: Path) -> list[dict[str, str]]:
    path = out / "runs/softmax/seed0-lr0.01/logs/metrics.csv"
    with open(path, newline="") as fh:
        return [r for r in csv.DictReader(fh) if r.get("train_loss")]


ARGS = ["train", "tiny", "--arms", "softmax", "--seeds", "1", "--epochs", "3"]


def test_train_is_quiet_labelled_and_refuses_to_clobber(
    tiny: _StopAtEpoch, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "o"
    args = [*ARGS[:-1], "2"]  # 2 epochs
    assert main([*args, "--out", str(out)]) == 0
    got = capfd.readouterr()
    text = got.out + got.err + caplog.text
    for noise in ("GPU available", "TPU available", "💡", "litlogger", "`Trainer.fit` stopped"):
        assert noise not in text, noise
    assert "run 1/1: arm softmax, seed 0, lr 0.01" in got.out
    assert [r["epoch"] for r in _rows(out)] == ["0", "1"]

    assert main([*args, "--out", str(out)]) == 2  # again, neither --resume nor --overwrite
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "--resume" in err and "--overwrite" in err
    assert "runs/softmax/seed0-lr0.01" in err

    assert main([*args, "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "finished earlier, skipped" in capfd.readouterr().out
    assert main([*args, "--out", str(out), "--overwrite", "--no-progress"]) == 0
    assert "skipped" not in capfd.readouterr().out


def test_ctrl_c_exits_130_and_resume_keeps_the_whole_metrics_log(
    tiny: _StopAtEpoch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    tiny.stop_at = 2
    assert main([*ARGS, "--out", str(out), "--no-progress"]) == 130
    err = capfd.readouterr().err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    assert [r["epoch"] for r in _rows(out)] == ["0", "1"]
    assert main([*ARGS, "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "resuming from epoch=1.ckpt (2/3 epochs done)" in capfd.readouterr().out
    rows = _rows(out)
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert all(float(r["train_loss"]) > 0 for r in rows)


def test_size_keys_listed_checked_and_typed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "ot-vit", "--list-sizes"]) == 0
    out = capsys.readouterr().out
    assert "d_model" in out and "bank_p" in out and "int" in out
    assert main(["train", "ot-vit", "--size", "help"]) == 0
    assert "d_model" in capsys.readouterr().out
    base = ["train", "ot-vit", "--quick", "--out", str(tmp_path), "--no-progress"]
    assert main([*base, "--size", "d_modle=16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --size d_modle: ") and "valid sizes: " in err and "d_model" in err
    assert main([*base, "--size", "d_model=abc"]) == 2
    assert capsys.readouterr().err.strip() == "error: --size d_model must be an integer, got 'abc'"
    assert main([*base, "--size", "bank_p=x"]) == 2
    assert "--size bank_p must be a number" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran
