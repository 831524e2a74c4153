"""Bench suite 'ot' runs on tiny sizes (timings are never asserted)."""
from __future__ import annotations

import torch

from attnopt.bench import BenchContext, all_suites
from attnopt.bench import ot as ot_bench


def test_suite_runs_tiny(monkeypatch):
    monkeypatch.setattr(ot_bench, "_cases", lambda ctx: [16, 24])
    monkeypatch.setattr(ot_bench, "MATERIALIZED_MAX_N", 16)
    rows = list(all_suites("ot")["ot"](BenchContext(quick=True, memory=False, repeat=1)))
    cases = {m.case for m in rows}
    assert len(cases) == 4  # 2 sizes x (fwd, fwd+bwd)
    for case in cases:
        group = [m for m in rows if m.case == case]
        assert sum(m.baseline for m in group) == 1
        assert all(m.seconds > 0 for m in group)
    assert all(len([m for m in rows if m.case == c]) == 3 for c in cases if c.startswith("N=16"))
    ours = [m for m in rows if m.impl == "ot_attention"]
    assert all("materialized" in m.note for m in ours)


def test_impls_agree_and_memory_factory_runs():
    z, t, u = ot_bench._inputs(12, False, "cpu")
    outs = {name: fn(z, t, u) for name, fn in ot_bench._impls().items()}
    torch.testing.assert_close(outs["ot_attention"], outs["materialized (22)"], rtol=1e-4, atol=1e-5)
    run = ot_bench.memory_factory(impl="ot_attention", n=8, backward=True)  # what the probe process runs
    run()
