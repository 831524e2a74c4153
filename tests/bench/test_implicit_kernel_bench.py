"""The implicit_kernel bench suite runs on tiny sizes and yields one baseline per case."""
from collections import Counter

import torch

import attnopt.bench.implicit_kernel as ikb
from attnopt.bench import BenchContext


def test_suite_runs_with_one_baseline_per_case(monkeypatch):
    monkeypatch.setattr(ikb, "H", 1)
    monkeypatch.setattr(ikb, "D", 8)
    monkeypatch.setattr(ikb, "LONG_N_QUICK", (64,))
    threads = torch.get_num_threads()
    rows = list(ikb.suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert torch.get_num_threads() == threads  # restored
    cases = Counter(r.case for r in rows if r.baseline)
    assert set(cases) == {r.case for r in rows} and set(cases.values()) == {1}
    assert all(r.seconds > 0 for r in rows)
    impls = {r.impl for r in rows}
    assert {"sdpa", "ikan R=8 linear mode", "mikan", "ikan-direct", "N=2048", "mikan R=16"} <= impls
    assert {"ikan quadratic mode", "ikan linear mode"} <= impls


def test_memory_factory_runs():
    run = ikb.memory_factory("ikan R=8 linear mode", 16)
    run()


def test_long_module_factory_runs_both_modes():
    for mode in ("quadratic", "linear"):
        ikb.long_module_factory(mode, 16)()
