"""The finiteness check as a ``torch.library`` op (issue 30 item 2): ``attnopt::any_nonfinite``."""
from __future__ import annotations

import pytest
import torch

from attnopt import _validation  # noqa: F401  (registers the op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_any_nonfinite_op(dtype: torch.dtype, bad: float | None) -> None:
    x = torch.randn(2, 3, 4, 5, dtype=dtype)
    if bad is not None:
        x[1, 2, 3, 4] = bad
    for t in (x, x.transpose(1, 3)):  # dense and strided
        torch.library.opcheck(torch.ops.attnopt.any_nonfinite, (t,))
        assert bool(torch.ops.attnopt.any_nonfinite(t)) == (bad is not None)


def test_any_nonfinite_op_under_compile() -> None:
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.ops.attnopt.any_nonfinite(t) | (t.sum() > 1e30), fullgraph=True,
                       backend="eager")
    assert not bool(fn(x))
    x[0, 0] = float("nan")
    assert bool(fn(x))
