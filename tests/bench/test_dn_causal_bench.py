"""The dn_causal bench suite runs on tiny sizes and skips out-of-reach Sinkhorn rows (no timing asserts)."""
import math

from attnopt.bench import BenchContext, all_suites
from attnopt.bench import dn_causal as bench


def test_suite_runs_on_tiny_sizes_with_one_causal_sdpa_baseline(monkeypatch):
    monkeypatch.setenv("ATTNOPT_BENCH_DN_CAUSAL_SIZES", "32")
    assert "dn_causal" in all_suites()
    rows = list(bench.suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert len(rows) == 10  # 5 implementations x (fwd, fwd+bwd)
    for case in {r.case for r in rows}:
        group = [r for r in rows if r.case == case]
        assert sum(r.baseline for r in group) == 1 and group[0].impl == "sdpa causal"
        assert all(math.isfinite(r.seconds) and r.seconds > 0 for r in group)
    bench.memory_factory("sinkhorn K=3 prefix", 16, True)()


def test_sinkhorn_prefix_row_is_skipped_where_out_of_reach(monkeypatch):
    monkeypatch.setenv("ATTNOPT_BENCH_DN_CAUSAL_SIZES", "4096")
    monkeypatch.setattr(bench, "_impls", lambda: {"sdpa causal": lambda q, k, v, w: q,  # noqa: ARG005
                                                 "sinkhorn K=3 prefix": lambda q, k, v, w: q})  # noqa: ARG005
    rows = list(bench.suite(BenchContext(quick=True, memory=False, repeat=1)))
    skipped = [r for r in rows if r.impl.startswith("sinkhorn")]
    assert skipped and all(math.isnan(r.seconds) and r.note.startswith("skipped") for r in skipped)
