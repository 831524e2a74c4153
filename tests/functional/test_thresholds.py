"""The one table of size thresholds (``functional/_thresholds.py``): overrides, the environment,
and that a threshold changes which implementation runs, never the result."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attnopt.functional import _thresholds, dispatch
from attnopt.functional._thresholds import THRESHOLDS, Thresholds, overrides
from attnopt.functional.doubly_normalized import doubly_normalized_attention
from tests.reference.doubly_normalized import attention_ref


def test_overrides_set_and_restore():
    before = THRESHOLDS.dnas_materialized_chunk_entries
    with overrides(dnas_materialized_chunk_entries=7) as table:
        assert table is THRESHOLDS and THRESHOLDS.dnas_materialized_chunk_entries == 7
    assert THRESHOLDS.dnas_materialized_chunk_entries == before
    with pytest.raises(RuntimeError), overrides(dnas_materialized_chunk_entries=3):
        raise RuntimeError
    assert THRESHOLDS.dnas_materialized_chunk_entries == before


@pytest.mark.parametrize("bad", [{"no_such_threshold": 1}, {"dnas_materialized_chunk_entries": -1},
                                 {"dnas_materialized_chunk_entries": 1.5},
                                 {"dnas_materialized_chunk_entries": True},
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
    """The chunk size moves Sinkhorn-K from one piece to one chunk per head; same values."""
    from attnopt.functional.doubly_normalized import materialized

    pieces = []
    real = materialized._forward_piece
    monkeypatch.setattr(materialized, "_forward_piece", lambda *a: pieces.append(a[0].shape[:2]) or real(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    ref = attention_ref(q, k, v, 2)
    outs = []
    for chunk in (1 << 20, 0):
        with overrides(dnas_materialized_chunk_entries=chunk):
            outs.append(doubly_normalized_attention(q, k, v, iterations=2, impl="materialized"))
    assert pieces == [(2, 3), *[(1, 1)] * 6]
    for out in outs:
        torch.testing.assert_close(out, ref)
