"""The whole-call Fourier-feature kernel as ``torch.library`` ops (issue 30 item 2):
``attnopt::ffw_fwd`` / ``attnopt::ffw_bwd`` — PyTorch's op checks and the op against the eager
autograd Function (values, gradients of q, k, v and the points; shared / per-head points, the L^p
magnitude with a key mask), one node under ``torch.compile(fullgraph=True)``, the profiler's names."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt import _native
from attnopt.functional.kernel import _fourier_c, _fourier_whole
from attnopt.functional.kernel import fourier as kf

pytestmark = pytest.mark.skipif(_native.compiler() is None or _native.blas() is None,
                                reason="no C compiler or no BLAS in PyTorch's library")


def _case(points_batch: tuple[int, ...], p: float | None, masked: bool):
    g = torch.Generator().manual_seed(0)
    b, h, nq, nk = 2, 3, 5, 6
    q = torch.randn(b, h, nq, 4, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(b, h, nk, 4, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(b, h, nk, 5, generator=g, dtype=torch.float64).requires_grad_()
    pts = (torch.randn(*points_batch, 6, 4, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    mask = None
    if masked:
        mask = torch.zeros(b, h, nk, dtype=torch.float64)
        mask[0, 1, 2:] = float("-inf")
    return (q, k, v, pts, mask, 1e-3, 1 / (2 * math.sqrt(3)), 2, p, 0.6)


CASES = [((), None, False), ((3,), 1.5, True), ((2, 3), 2.0, True)]


@pytest.mark.parametrize(("points_batch", "p", "masked"), CASES)
def test_opcheck_and_equal_to_the_function(points_batch: tuple[int, ...], p: float | None,
                                           masked: bool) -> None:
    args = _case(points_batch, p, masked)
    q, k, v, pts = args[:4]
    torch.library.opcheck(torch.ops.attnopt.ffw_fwd, (*args, True))
    cfg = _fourier_whole._whole_call(q, k, v, pts, args[4])
    assert cfg is not None
    want = kf._WholeFourier.apply(*args, cfg)
    got = torch.ops.attnopt.ffw_fwd(*args, True)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    dout = torch.randn_like(want)
    ins = (q, k, v, pts)
    for a, b in zip(torch.autograd.grad(got, ins, dout), torch.autograd.grad(want, ins, dout), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    det = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    out, save = torch.ops.attnopt.ffw_fwd(*det, True)
    for need in (True, False):
        bargs = (torch.randn_like(out), *det[:4], save, out, *det[5:8], p is not None, need, need, True, need)
        torch.library.opcheck(torch.ops.attnopt.ffw_bwd, bargs)


def test_one_node_under_compile_and_in_the_profiler() -> None:
    q, k, v, pts, mask, *rest = _case((3,), 2.0, True)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnopt.ffw_fwd(q, k, v, pts, mask, *rest, True)[0].square().sum()

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v, pts)
    want = fn(q, k, v, pts)
    torch.testing.assert_close(got, want)
    assert any(t.startswith("attnopt.ffw_fwd") for t in seen)
    ins = (q, k, v, pts)
    for a, b in zip(torch.autograd.grad(got, ins), torch.autograd.grad(want, ins), strict=True):
        torch.testing.assert_close(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, k, v, pts).backward()
    assert {"attnopt::ffw_fwd", "attnopt::ffw_bwd"} <= {ev.name for ev in prof.events()}


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 1.3])
@pytest.mark.parametrize("grad", [False, True])
def test_lp_magnitude_op(p: float, grad: bool) -> None:
    """``attnopt::lp_magnitude``: op checks, and the eager helper's values (no autograd: factors)."""
    k = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.library.opcheck(torch.ops.attnopt.lp_magnitude, (k, p, 0.7, grad))
    a, u, c = torch.ops.attnopt.lp_magnitude(k, p, 0.7, grad)
    want = _fourier_c._magnitude(k, p, 0.7, grad)
    torch.testing.assert_close(a, want[0], atol=0, rtol=0)
    total = k.abs().pow(p).sum(-1)
    torch.testing.assert_close(a, 0.35 * total.pow(2 / p))
    if grad:
        torch.testing.assert_close(u, want[1], atol=0, rtol=0)
        torch.testing.assert_close(c, want[2], atol=0, rtol=0)
    else:
        assert u.numel() == 0 and c.numel() == 0
