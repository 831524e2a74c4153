"""The regularized bench suite runs on tiny sizes (timings are never asserted)."""
from attnopt.bench import BenchContext, all_suites
from attnopt.bench import regularized as bench


def test_suite_runs_tiny(monkeypatch):
    monkeypatch.setattr(bench, "QUICK_MAP", (2, 16))
    monkeypatch.setattr(bench, "QUICK_ATTN", [16])
    monkeypatch.setattr(bench, "QUICK_VS_SOFTMAX", (2, [16]))
    suite = all_suites("regularized")["regularized"]
    rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    groups = {r.case for r in rows}
    assert len(groups) == 7
    vs = [r for r in rows if r.case.startswith("vs softmax")]
    assert {r.extra["threads"] for r in vs} == {1, 2}
    assert {r.impl for r in vs} == {"torch.softmax", "attnopt.sparsemax", "attnopt.entmax(1.5)",
                                    "entmax.sparsemax (package)", "entmax.entmax15 (package)"}
    ours = [r for r in vs if r.impl.startswith("attnopt")]
    assert all(r.extra["package_speedup"] > 0 and r.extra["vs_softmax"] > 0 for r in ours)
    # the path that ran is reported: the C kernels where a compiler exists, else the PyTorch ops
    from attnopt import _native

    assert all(r.extra["native"] == float(_native.library("sparse_maps") is not None) for r in ours)
    assert all(("C kernel" in r.note) == bool(r.extra["native"]) for r in ours)
    for case in groups:
        assert sum(r.baseline for r in rows if r.case == case) == 1
    errs = {r.impl: r.extra["max_err"] for r in rows if "max_err" in r.extra}
    assert errs["attnopt.entmax(1.5)"] < 1e-6 and errs["attnopt.sparsemax"] < 1e-6
    assert all(r.seconds > 0 for r in rows)
