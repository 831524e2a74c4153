"""The small_n bench suite runs on tiny sizes and reports the path ``auto`` chose (timings never asserted)."""
import math

import pytest

from attnopt import _native
from attnopt.bench import BenchContext, small_n
from attnopt.functional import dispatch


def test_suite_runs_and_notes_the_dispatch(monkeypatch):
    monkeypatch.setattr(small_n, "_cases", lambda ctx: [(1, 16)])  # noqa: ARG005
    monkeypatch.setattr(small_n, "_registry_rows", lambda ctx, n, repeat: iter(()))  # noqa: ARG005
    monkeypatch.setattr(small_n, "_encoder_rows", lambda ctx, n, repeat: iter(()))  # noqa: ARG005
    rows = list(small_n.suite(BenchContext(quick=False, memory=False, repeat=1)))
    cases = {r.case for r in rows}
    assert len(cases) == 2  # fwd, fwd+bwd
    for case in cases:
        group = [r for r in rows if r.case == case]
        assert sum(r.baseline for r in group) == 1
        assert all(math.isfinite(r.seconds) and r.seconds > 0 for r in group)
        names = {r.impl for r in group}
        for name, key in small_n.DISPATCHED.items():
            auto = next(r for r in group if r.impl == name)
            # 8·16² entries: below every crossover; generalized attention streams (SDPA itself) unless
            # the whole-call C path takes its T5 / ALiBi bias (materialized, kernel "fused")
            blas = _native.compiler() is not None and _native.blas() is not None
            fused = key == "generalized" and blas and "fwd+bwd" in case
            path = "streaming" if key == "generalized" and not fused else "materialized"
            assert auto.note.startswith(f"auto -> {path}")
            other = "materialized" if path == "streaming" else "streaming"
            assert f"{name} [{other}]" in names
            if key == "generalized":
                assert "SDPA itself at B*H*N^2 <=" in auto.note
                assert ("whole-call C path" in auto.note) == blas
                assert ("kernel fused" in auto.note) == fused
            if "learned" in name:  # a bias with a gradient takes the materialized node above that
                assert "a learned bias: always" in auto.note
            else:
                assert str(dispatch.CROSSOVERS[key]["float32"]) in auto.note
        for name in small_n.SAME_FUNCTION:  # the ratio to the SDPA row computing the same function
            assert "x the same-function SDPA row" in next(r for r in group if r.impl == name).note


@pytest.mark.slow  # ~20 s: builds and trains every registry attention once
def test_registry_and_encoder_rows_cover_every_name(monkeypatch):
    from attnopt.nn.registry import attention_names

    monkeypatch.setattr(small_n, "H", 2)
    monkeypatch.setattr(small_n, "D", 4)
    ctx = BenchContext(quick=True, memory=False, repeat=1)
    reg = list(small_n._registry_rows(ctx, 8, 1))
    assert {r.impl for r in reg} == set(attention_names()) - {"ot"}
    assert sum(r.baseline for r in reg) == 1 and all(r.seconds > 0 for r in reg)
    enc = list(small_n._encoder_rows(ctx, 8, 1))
    assert {r.impl for r in enc} == set(attention_names()) - {"ot", "mem"}
