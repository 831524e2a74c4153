"""``attnopt._native.ready``: the "library built" answer that traced routers read (issue 30).

``library`` answers ``None`` while dynamo traces (ctypes cannot run in a traced region);
``ready`` is answered at trace time and kept as a constant of the graph, so a process that
compiles before any eager call still puts the ``attnopt::`` ops in its graphs.
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt import _native


def _branch(x: torch.Tensor) -> torch.Tensor:
    return x + 1 if _native.ready("sparse_maps", "blas") else x - 1


def test_ready_under_fullgraph_compile_equals_the_eager_answer() -> None:
    want = _native.library("sparse_maps") is not None and _native.blas() is not None
    assert _native.ready("sparse_maps", "blas") is want
    torch._dynamo.reset()
    x = torch.zeros(3)
    got = torch.compile(_branch, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, x + 1 if want else x - 1)


def test_ready_is_false_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    assert not _native.ready("sparse_maps")
    monkeypatch.delenv("ATTNOPT_NATIVE")
    with attnopt.backend("reference"):
        assert not _native.ready("sparse_maps")
