"""Small C fills as ``torch.library`` ops (issue 30 item 2): ``attnopt::t5_toeplitz`` (T5's bias
from its bucket table) and ``attnopt::normal_fill`` (the seeded Gaussian noise) — op checks,
equality with the eager paths, one node under ``torch.compile(fullgraph=True)``."""
from __future__ import annotations

import pytest
import torch

from attnopt.functional.kernel.gaussian_noise import _mirror, noise_from_seed
from attnopt.nn.preference import _T5Bias, t5_toeplitz
from tests._marks import needs_native

pytestmark = needs_native


def _t5(dtype: torch.dtype = torch.float64, nq: int = 5, nk: int = 7):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(6, 3, generator=g, dtype=dtype).requires_grad_()
    buckets = torch.randint(0, 6, (nq + nk - 1,), generator=g)
    return table, buckets, nq, nk


@pytest.mark.parametrize("index", [False, True])
def test_t5_op(index: bool) -> None:
    table, buckets, nq, nk = _t5()
    # the flat offset index j − i + Nq − 1 of every entry (T5RelativePreference's cached route)
    idx = ((torch.arange(nk) - torch.arange(nq)[:, None]) + nq - 1).reshape(-1) if index else None
    torch.library.opcheck(torch.ops.attnopt.t5_toeplitz, (table, buckets, idx, nq, nk))
    want = _T5Bias.apply(table, buckets, idx, nq, nk)
    got = t5_toeplitz(table, buckets, idx, nq, nk)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    plain = table.t()[:, buckets].unfold(-1, nk, 1).flip(-2).reshape(1, 3, nq, nk)
    torch.testing.assert_close(got, plain, atol=0, rtol=0)
    grad = torch.randn_like(got)
    (a,) = torch.autograd.grad(got, table, grad)
    (b,) = torch.autograd.grad(want, table, grad)
    torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda t: t5_toeplitz(t, buckets, idx, nq, nk), (table,))


def test_t5_op_one_node_under_compile() -> None:
    table, buckets, nq, nk = _t5(torch.float32)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t5_toeplitz(t, buckets, None, nq, nk).square().sum()

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(table)
    torch.testing.assert_close(got, fn(table))
    assert any(s.startswith("attnopt.t5_toeplitz") for s in seen)
    torch.testing.assert_close(torch.autograd.grad(got, table)[0], torch.autograd.grad(fn(table), table)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_fill_op(dtype: torch.dtype) -> None:
    seed = torch.tensor(1234567, dtype=torch.int64)  # as draw_seed gives it (0-d)
    torch.library.opcheck(torch.ops.attnopt.normal_fill, (seed, [3, 5], dtype))
    got = torch.ops.attnopt.normal_fill(seed, [3, 5], dtype)
    torch.testing.assert_close(got, noise_from_seed(seed, (3, 5), dtype), atol=0, rtol=0)
    torch.testing.assert_close(got, _mirror(seed, (3, 5)).to(dtype), atol=0, rtol=0)
    torch._dynamo.reset()
    fn = torch.compile(lambda s: torch.ops.attnopt.normal_fill(s, [3, 5], dtype) * 2, fullgraph=True,
                       backend="eager")
    torch.testing.assert_close(fn(seed), 2 * got)
