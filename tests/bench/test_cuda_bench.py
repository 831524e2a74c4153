"""The cuda bench suite: nothing on a CPU by default; its logic in Triton's interpreter (slow)."""
import pytest

from attnopt.bench import BenchContext, all_suites


def test_cuda_suite_is_empty_on_a_cpu_by_default(monkeypatch):
    monkeypatch.delenv("ATTNOPT_BENCH_CUDA_SIZES", raising=False)
    assert list(all_suites("cuda")["cuda"](BenchContext(device="cpu", memory=False, repeat=1))) == []


@pytest.mark.slow
def test_cuda_suite_logic_in_the_interpreter(monkeypatch):
    """~30 s on a CPU: every case, one baseline each, our rows named with their target."""
    pytest.importorskip("triton")
    monkeypatch.setenv("ATTNOPT_BENCH_CUDA_SIZES", "24")
    rows = list(all_suites("cuda")["cuda"](BenchContext(device="cpu", memory=False, repeat=1)))
    cases = {r.case for r in rows}
    assert len(cases) == 8
    for case in cases:
        assert sum(r.baseline for r in rows if r.case == case) == 1
    ours = [r for r in rows if r.impl.startswith("attnopt")]
    assert len(ours) == 8 and all(r.seconds > 0 for r in ours)
    assert sum("target" in r.note for r in ours) == 5
