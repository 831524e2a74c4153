"""The small_n bench suite runs on tiny sizes and reports the path ``auto`` chose (timings never asserted)."""
import math
import time

import pytest

from attnopt import _native
from attnopt.bench import BenchContext, small_n
from attnopt.functional import dispatch


def test_suite_runs_and_notes_the_dispatch(monkeypatch):
    monkeypatch.setattr(small_n, "_cases", lambda ctx: [(1, 16)])  # noqa: ARG005
    monkeypatch.setattr(small_n, "_registry_rows", lambda ctx, n, repeat: iter(()))  # noqa: ARG005
    monkeypatch.setattr(small_n, "_encoder_rows", lambda ctx, n, repeat: iter(()))  # noqa: ARG005
    monkeypatch.setattr(small_n, "_registry_runs", lambda ctx, n: iter(()))  # noqa: ARG005
    monkeypatch.setattr(small_n, "_encoder_runs", lambda ctx, n, **kw: iter(()))  # noqa: ARG005
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


def test_every_section_runs_its_rows_untimed_before_the_first_timed_row(monkeypatch):
    """The warm-up round: every function row of the first case (fwd and fwd+bwd, WARMUP_CALLS
    each), every registry module and every encoder arm run before their section's first timed
    row, so the baselines (timed first) do not pay the first-call costs."""
    events: list[tuple[str, str]] = []
    timed: dict[str, int] = {}  # section -> number of its calls before its first timed row
    monkeypatch.setattr(small_n, "_cases", lambda ctx: [(1, 8)])  # noqa: ARG005
    real_impls, real_best = small_n._impls, small_n._best

    def logged(kind, name, fn):
        def run(*args):
            events.append((kind, name))
            return fn(*args) if args else None
        return run

    monkeypatch.setattr(small_n, "_impls", lambda device, impl: {
        name: logged("fn", name, fn) for name, fn in real_impls(device, impl).items()})
    monkeypatch.setattr(small_n, "_registry_runs", lambda ctx, n: iter(  # noqa: ARG005
        [(name, logged("reg", name, None)) for name in ("softmax", "dnas")]))
    monkeypatch.setattr(small_n, "_encoder_runs", lambda ctx, n, **kw: iter(  # noqa: ARG005
        [(name, logged("enc", name, None)) for name in ("softmax", "t5")]))

    def best(fn, repeat, device):
        start = len(events)
        out = real_best(fn, repeat, device)
        if len(events) > start:  # a logged row (not the two SDPA-with-bias rows)
            timed.setdefault(events[start][0], start)
        return out

    real_interleaved = small_n._interleaved

    def interleaved(runs, repeat, device):  # the function rows' timed rounds
        timed.setdefault("fn", len(events))
        return real_interleaved(runs, repeat, device)

    monkeypatch.setattr(small_n, "_best", best)
    monkeypatch.setattr(small_n, "_interleaved", interleaved)
    rows = list(small_n.suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert rows and all(r.seconds > 0 for r in rows)
    # function rows: the warm-up round (fwd and fwd+bwd), then the row's own untimed first call
    for kind, calls in (("fn", 2 * small_n.WARMUP_CALLS + 1), ("reg", 2), ("enc", 1)):
        before = [name for k, name in events[: timed[kind]] if k == kind]
        names = {name for k, name in events if k == kind}
        assert len(names) > 1 and all(before.count(name) == calls for name in names), (kind, before)


def test_function_rows_are_timed_in_interleaved_rounds():
    """Each round times one call of every row in turn, so a slow spell of the machine costs every
    row one round (not all the rounds of the rows timed in it); the minimum per row is kept."""
    calls: list[str] = []

    def heavy() -> None:
        sum(range(300_000))

    def row(name):
        def run():
            calls.append(name)
            if name == "b" and calls.count("b") <= 2:  # b's first two rounds are slow
                heavy()
        return run

    best = small_n._interleaved({"a": row("a"), "b": row("b")}, 4, "cpu")
    assert calls == ["a", "b"] * 4
    c0 = time.thread_time()
    heavy()
    slow = time.thread_time() - c0
    assert set(best) == {"a", "b"} and best["b"][0] < slow / 2
