"""Issue 29: C kernels reached from frames that ``torch.compile`` traced corrupted the heap.

Dynamo hands a resumed frame only the locals used later, so a scratch buffer whose address had
been taken was freed before the C call wrote to it. Every address-taking frame now runs untraced
(:func:`attnopt._native.untraced`). The repro runs in a subprocess: a crash there fails one test
instead of killing the suite.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnopt.nn.registry import attention_names

ROOT = Path(__file__).resolve().parents[2]


def _run(names: list[str], threads: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, "-m", "tests.native._traced_modules", f"--threads={threads}", *names]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _check(done: subprocess.CompletedProcess, names: list[str]) -> None:
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    assert done.stdout.count(" ok\n") == len(names)
    assert done.stdout.rstrip().endswith("checked")


def test_issue_repro_two_traced_ikan_direct_modules() -> None:
    names = ["ikan-direct", "ikan-direct"]
    _check(_run(names), names)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_every_ordered_pair_of_registry_modules_traced_in_turn(threads: int) -> None:
    """Every ordered pair (a, b) of registry modules appears consecutively in one chain."""
    names = [n for n in attention_names() if n != "mem"]
    chain = [names[0]]
    for a, b in itertools.product(names, repeat=2):  # an Eulerian-style walk, repeats allowed
        if chain[-1] != a:
            chain.append(a)
        chain.append(b)
    _check(_run(chain, threads, timeout=3600), chain)


@pytest.mark.slow
def test_issue_chains() -> None:
    for names in (["ikan", "mikan"], ["mikan", "ikan-direct"], ["ika-ns", "expsin", "ikan"]):
        _check(_run(names), names)
