"""The one table of size thresholds (``functional/_thresholds.py``): overrides, the environment,
and that a threshold changes which implementation runs, never the result."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attnopt.functional import _thresholds, dispatch
from attnopt.functional._thresholds import THRESHOLDS, Thresholds, overrides
from attnopt.functional.doubly_normalized import cpu, doubly_normalized_attention, materialized
from tests.reference.doubly_normalized import attention_ref


def test_overrides_set_and_restore():
    before = THRESHOLDS.dnas_cpu_no_grad_max_entries
    with overrides(dnas_cpu_no_grad_max_entries=7) as table:
        assert table is THRESHOLDS and THRESHOLDS.dnas_cpu_no_grad_max_entries == 7
    assert THRESHOLDS.dnas_cpu_no_grad_max_entries == before
    with pytest.raises(RuntimeError), overrides(dnas_cpu_no_grad_max_entries=3):
        raise RuntimeError
    assert THRESHOLDS.dnas_cpu_no_grad_max_entries == before


@pytest.mark.parametrize("bad", [{"no_such_threshold": 1}, {"dnas_cpu_no_grad_max_entries": -1},
                                 {"dnas_cpu_no_grad_max_entries": 1.5},
                                 {"dnas_cpu_no_grad_max_entries": True},
                                 {"crossovers": 1}])
def test_overrides_refuse_unknown_names_and_bad_values(bad):
    before = dataclasses.asdict(THRESHOLDS)
    with pytest.raises(ValueError, match="threshold"), overrides(**bad):
        pass
    assert dataclasses.asdict(THRESHOLDS) == before


def test_environment_is_parsed(monkeypatch):
    monkeypatch.setattr(_thresholds, "THRESHOLDS", table := Thresholds())
    _thresholds._from_environment(" dnas_native_min_entries=0x10 , dnas_streaming_block=64,")
    assert table.dnas_native_min_entries == 16 and table.dnas_streaming_block == 64
    for text, match in (("dnas_streaming_block", "name=int"), ("dnas_streaming_block=x", "needs an int"),
                        ("nope=1", "unknown threshold")):
        with pytest.raises(ValueError, match=match):
            _thresholds._from_environment(text)


def test_crossovers_are_the_dispatch_table():
    assert dispatch.CROSSOVERS is THRESHOLDS.crossovers
    assert {"doubly_normalized", "sinkhorn", "hybrid_normalized", "sparse", "generalized",
            "kernel"} <= set(THRESHOLDS.crossovers)


def test_a_threshold_picks_the_kernel_not_the_result(monkeypatch):
    """``dnas_native_min_entries`` moves float32 DNAS from the probability-domain kernel to the C
    passes; same values (to float32 rounding)."""
    if cpu.library(torch.zeros(1), 1) is None:
        pytest.skip("no native library (no compiler or ATTNOPT_NATIVE=0)")
    calls = []
    for module, name in ((materialized, "materialized_sinkhorn"), (cpu, "native_sinkhorn")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g).requires_grad_() for _ in range(3))
    ref = attention_ref(q.double(), k.double(), v.double(), 1)
    outs = []
    for least in (1 << 40, 0):
        with overrides(dnas_native_min_entries=least):
            outs.append(doubly_normalized_attention(q, k, v, iterations=1, impl="materialized"))
    assert calls == ["materialized_sinkhorn", "native_sinkhorn"]
    for out in outs:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
