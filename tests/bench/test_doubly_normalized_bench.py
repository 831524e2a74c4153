"""The doubly_normalized bench suite runs on tiny sizes (timings are never asserted)."""
import math

import torch

from attnopt.bench import BenchContext
from attnopt.bench.doubly_normalized import materialized_sinkhorn_peer, memory_factory, suite
from tests.reference.doubly_normalized import attention_ref


def test_suite_runs_on_tiny_sizes(monkeypatch):
    monkeypatch.setenv("ATTNOPT_BENCH_DN_SIZES", "32")
    rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert len(rows) == 12  # 6 implementations x (fwd, fwd+bwd)
    for case in {r.case for r in rows}:
        group = [r for r in rows if r.case == case]
        assert sum(r.baseline for r in group) == 1 and group[0].impl == "sdpa"
        assert all(math.isfinite(r.seconds) and r.seconds > 0 for r in group)


def test_peer_is_a_correct_sinkhorn_and_factory_runs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for it in (1, 3):
        torch.testing.assert_close(materialized_sinkhorn_peer(q, k, v, it), attention_ref(q, k, v, it))
    run = memory_factory("dnas K=3", 16, True)
    run()
