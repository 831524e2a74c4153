"""``attnopt._native.untraced``: a frame that hands tensor addresses to C is never traced by dynamo,
nor are the helpers it calls — in eager code (called directly: no wrapper cost) and inside a
compiled function (a graph break, then the frame runs with dynamo's eval-frame callback off)."""
from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from attnopt._native import untraced

seen: list[tuple[str, bool]] = []


def _helper(x: torch.Tensor) -> torch.Tensor:
    seen.append(("helper", get_eval_frame_callback() is None))
    return x


@untraced
def _address_taker(x: torch.Tensor) -> torch.Tensor:
    seen.append(("frame", get_eval_frame_callback() is None))
    return _helper(x) + 1


def _model(x: torch.Tensor) -> torch.Tensor:
    return _address_taker(x * 2) * 3


def test_eager_call_runs_the_frame_directly() -> None:
    seen.clear()
    assert torch.equal(_model(torch.ones(2)), torch.full((2,), 9.0))
    assert seen == [("frame", True), ("helper", True)]


def test_compiled_caller_runs_the_frame_and_its_callees_untraced() -> None:
    torch._dynamo.reset()
    seen.clear()
    compiled = torch.compile(_model, backend="eager")
    for _ in range(2):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 9.0))
    # a traced frame would record nothing (tracing skips the append's effect) or run with a callback
    assert seen == [("frame", True), ("helper", True)] * 2
    explained = torch._dynamo.explain(_model)(torch.ones(2))
    assert explained.graph_break_count == 1
    assert "disable" in str(explained.break_reasons[0].reason)
