"""Traced graphs hold the attnopt ops (issue 30 item 2): the routers of the regularized and
generalized families, and T5's bias, call ``torch.ops.attnopt.*`` while ``torch.compile`` /
``torch.export`` trace CPU tensors, and the graph matches eager (values and gradients).

* sparsemax / 1.5-entmax attention: ``attnopt::sparse_map_fwd`` (forward graph) and
  ``sparse_map_bwd`` (backward graph);
* generalized attention with a bias (T5, ALiBi): ``attnopt::bs_fwd`` / ``bs_bwd``;
* T5's bias itself: ``attnopt::t5_toeplitz``.

The graphs are read from an AOTAutograd backend that records the forward and backward graphs it
is handed (``fullgraph=True``), and from ``torch.export.export`` in eval mode. The first case runs
by default; the rest are ``-m slow`` (a few seconds of tracing each):
``pytest -m slow tests/functional/test_traced_ops.py``.
"""
from __future__ import annotations

import collections

import pytest
import torch

from attnopt import _native
from attnopt.functional.regularized import cpu as sparse_cpu
from attnopt.nn.registry import make_attention

#: registry name -> the attnopt ops expected in (forward + backward graphs, the exported program)
CASES = {
    "sparsemax": ({"sparse_map_fwd", "sparse_map_bwd"}, {"sparse_map_fwd"}),
    "entmax": ({"sparse_map_fwd", "sparse_map_bwd"}, {"sparse_map_fwd"}),
    "t5": ({"t5_toeplitz", "bs_fwd", "bs_bwd"}, {"t5_toeplitz", "bs_fwd"}),
    "alibi": ({"bs_fwd", "bs_bwd"}, {"bs_fwd"}),
}


def _ops(graphs: list[torch.fx.Graph]) -> collections.Counter:
    """``attnopt`` op names (``sparse_map_fwd``, ...) called in ``graphs``, with their counts."""
    return collections.Counter(
        str(n.target).split(".")[1] for g in graphs for n in g.nodes
        if n.op == "call_function" and str(n.target).startswith("attnopt."))


def _run(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    out = module(x)[0]
    grads = torch.autograd.grad(out.square().sum(), [x, *module.parameters()], allow_unused=True)
    return out.detach(), list(grads)


@pytest.mark.parametrize("name", [n if n == "sparsemax" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_compiled_and_exported_graphs_hold_the_op(name: str) -> None:
    if not (sparse_cpu.ready() and _native.ready("biased_softmax")):
        pytest.skip("the C kernels are not built (no compiler or ATTNOPT_NATIVE=0)")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    module = make_attention(name, 16, 2)
    x = torch.randn(2, 12, 16, requires_grad=True)
    out, grads = _run(module, x)
    graphs: list[torch.fx.Graph] = []

    def record(gm: torch.fx.GraphModule, _inputs: list) -> object:
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    got, got_grads = _run(compiled, x)
    torch.testing.assert_close(got, out, atol=2e-5, rtol=2e-5)
    for a, b in zip(got_grads, grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    want_compiled, want_exported = CASES[name]
    assert set(_ops(graphs)) == want_compiled
    assert all(c == 1 for c in _ops(graphs).values())  # one op each way, not one per head

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.inner(t)[0]

    wrapped = Wrapped().eval()
    program = torch.export.export(wrapped, (x.detach(),))
    assert set(_ops([program.graph])) == want_exported
    y = torch.randn(2, 12, 16)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(y), wrapped(y), atol=2e-5, rtol=2e-5)


def test_unsettled_rows_take_the_sort_value_in_a_traced_graph() -> None:
    """Rows the C search does not settle (``max_iter = 1``) get the sort value, inside the one op:
    the graph holds ``sparse_map_fwd`` and no ``where`` selection."""
    if not sparse_cpu.ready():
        pytest.skip("the C kernels are not built")
    from attnopt.functional.regularized import _maps
    from tests.reference.regularized import entmax15_sort

    x = torch.randn(6, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3

    def f(t: torch.Tensor) -> torch.Tensor:
        return _maps.threshold_map(t, 1.5, -1, 1, 1e-12)[0]

    _, _, status = sparse_cpu.forward_status(x, 1.5, 1)
    assert (status == 1).any()  # one sweep settles few rows: the fallback is exercised
    torch._dynamo.reset()
    graphs: list = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    got = torch.compile(f, fullgraph=True, backend=backend)(x)
    torch.testing.assert_close(got, entmax15_sort(x), atol=1e-12, rtol=0)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("sparse_map_fwd" in t for t in targets) and not any("where" in t for t in targets), targets
