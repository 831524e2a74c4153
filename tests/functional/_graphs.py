"""What a compiled graph holds: a dynamo backend that records the call targets (issue 30's tests
of the ``attnopt::`` ops in compiled and exported graphs)."""
from __future__ import annotations

from collections.abc import Callable

import torch


class Recorder:
    """A dynamo backend that runs AOT autograd and records the call targets of the forward and
    backward graphs (as ``aot_eager`` would run them)."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g: torch.fx.GraphModule, _: list) -> Callable:
            self.targets += [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, inputs, fw_compiler=record, bw_compiler=record)

    def count(self, name: str) -> int:
        return sum(t.startswith(name) for t in self.targets)


def compiled_equals_eager(fn: Callable[..., torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> Recorder:
    """``torch.compile(fn, fullgraph=True)`` through a :class:`Recorder`: its value and the gradients
    of ``leaves`` (under one random output gradient) equal eager's; returns the recorder."""
    want = fn(*leaves)
    rec = Recorder()
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=rec)(*leaves)
    torch.testing.assert_close(got, want)
    go = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=got.dtype)
    for a, b in zip(torch.autograd.grad(got, leaves, go), torch.autograd.grad(want, leaves, go), strict=True):
        torch.testing.assert_close(a, b)
    return rec
