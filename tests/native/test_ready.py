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


def test_the_threading_threshold_is_in_the_one_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_native.parallel_rows`` reads ``THRESHOLDS.native_parallel_min_entries`` at call time."""
    from attnopt.functional._thresholds import THRESHOLDS, overrides

    assert _native.TABLE == [THRESHOLDS]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    seen: list[tuple[int, int]] = []
    with overrides(native_parallel_min_entries=1 << 30):
        _native.parallel_rows(lambda a, b: seen.append((a, b)), 4, 8)
    assert seen == [(0, 4)]  # below the threshold: one call
    seen.clear()
    with overrides(native_parallel_min_entries=0):
        _native.parallel_rows(lambda a, b: seen.append((a, b)), 4, 8)
    assert sorted(seen) == [(0, 2), (2, 4)]
