"""The Triton kernels compile for sm_90 without a GPU (slow: ~3 min of CPU; `pytest -m slow`)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.functional.triton._compile_sm90"], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 30
