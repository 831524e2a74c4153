"""The sparse-map C kernels as ``torch.library`` ops (issue 30 item 2): ``attnopt::sparse_map_*``."""

from __future__ import annotations

import pytest
import torch

from attnopt.functional.regularized import cpu as _sparse_ops
from attnopt.functional.regularized import entmax, sparsemax
from tests._marks import needs_native

pytestmark = needs_native


def _x(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    x = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[0, 1, :4] = float("-inf")  # masked entries
    x[1, 2] = 0.25  # a row of ties
    return x


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_opcheck(alpha: float) -> None:
    """PyTorch's op checks: schema, fake (meta) implementation, autograd registration, AOT."""
    x = _x().requires_grad_()
    torch.library.opcheck(torch.ops.attnopt.sparse_map_fwd, (x, alpha, 1000))
    p = _sparse_ops.sparse_map(x.detach(), alpha)
    torch.library.opcheck(torch.ops.attnopt.sparse_map_bwd, (p, torch.randn_like(p), alpha))


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_op_equals_the_map_and_its_gradient(alpha: float) -> None:
    x = _x().requires_grad_()
    ref = sparsemax(x) if alpha == 2.0 else entmax(x, 1.5)
    got = _sparse_ops.sparse_map(x, alpha)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    g = torch.randn_like(x)
    (want,) = torch.autograd.grad(ref, x, g)
    (have,) = torch.autograd.grad(got, x, g)
    torch.testing.assert_close(have, want, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda t: _sparse_ops.sparse_map(t, alpha), (_x()[1:2, :2].requires_grad_(),)
    )


def test_op_is_one_node_under_compile() -> None:
    """dynamo records the op as one call (no graph break: fullgraph) and matches eager."""
    x = _x(torch.float32)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda t: _sparse_ops.sparse_map(t, 1.5) * 2, fullgraph=True, backend=backend)
    torch.testing.assert_close(fn(x), 2 * entmax(x, 1.5))
    assert any(s.startswith("attnopt.sparse_map_fwd") for s in seen)


def test_meta_shapes_from_the_fake_implementation() -> None:
    x = torch.empty(4, 3, 9, device="meta")
    p, theta, status = torch.ops.attnopt.sparse_map_fwd(x, 2.0, 10)
    assert (
        p.shape == x.shape
        and theta.shape == (4, 3, 1)
        and status.shape == (12,)
        and status.dtype == torch.int8
    )
