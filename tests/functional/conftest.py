"""Fixtures shared by the functional tests."""
from __future__ import annotations

import pytest

from attnopt import _native


@pytest.fixture(params=["native", "torch"])
def native_or_torch(request, monkeypatch):
    """Run a test on a C kernel (skipped without a compiler) and on its PyTorch fallback
    (``ATTNOPT_NATIVE=0``), each with a fresh loader (the library stays cached on disk)."""
    if request.param == "native":
        if _native.compiler() is None:
            pytest.skip("no C compiler on this machine")
        monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
    else:
        monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    monkeypatch.setattr(_native, "_LIBS", {})
    return request.param
