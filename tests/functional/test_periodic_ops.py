"""The periodic (Expsin) C passes as ``torch.library`` ops (issue 30 item 2): ``attnopt::px_fwd`` /
``attnopt::px_bwd`` — PyTorch's op checks and the op against the eager autograd Function on the
arguments the router really hands it (masks, the L^p magnitude's key bias, P saved or recomputed),
one node under ``torch.compile(fullgraph=True)``, and the op's name in the profiler."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention
from attnopt.functional.kernel import periodic_cpu as native
from attnopt.kernels import Periodic
from tests._marks import needs_native

pytestmark = needs_native


def _arguments(monkeypatch: pytest.MonkeyPatch, mask: bool, p: float | None, save: bool) -> tuple:
    """What the router hands the eager Function for a small float64 call."""
    seen: list[tuple] = []
    real = native._NativePeriodic.apply
    monkeypatch.setattr(native._NativePeriodic, "apply", lambda *a: seen.append(a) or real(*a))
    monkeypatch.setattr(THRESHOLDS, "periodic_save_bytes", 1 << 30 if save else 0)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64).requires_grad_() for n in (5, 6))
    v = torch.randn(2, 2, 6, 3, generator=g, dtype=torch.float64).requires_grad_()
    m = torch.zeros(2, 1, 5, 6, dtype=torch.float64)
    m[0, 0, 1, :2] = float("-inf")
    kernel_attention(q, k, v, kernel=Periodic(2 * math.pi), magnitude_p=p, attn_mask=m if mask else None)
    assert seen, "the C path did not run"
    return seen[-1]


CASES = [(False, 2.0, True), (True, 1.5, False), (False, None, False)]


@pytest.mark.parametrize(("mask", "p", "save"), CASES)
def test_opcheck_and_equal_to_the_function(monkeypatch: pytest.MonkeyPatch, mask: bool, p: float | None,
                                           save: bool) -> None:
    q, k, v, e, m, rep, om2, c, s, sv, step, lead = _arguments(monkeypatch, mask, p, save)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    e = None if e is None else e.detach().requires_grad_()
    args = (q, k, v, e, m, rep, om2, c, s, sv, step)
    torch.library.opcheck(torch.ops.attnopt.px_fwd, args)
    want = native._NativePeriodic.apply(*args, lead)
    got = torch.ops.attnopt.px_fwd(*args)[0].view(want.shape)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    ins = [t for t in (q, k, v, e) if t is not None]
    dout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, ins, dout), torch.autograd.grad(want, ins, dout), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    det = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    out, aux, state, pa, sc = torch.ops.attnopt.px_fwd(*det)
    for need in (True, False):
        bargs = (torch.randn_like(out), *det[:3], m, aux, state, out, pa, sc, rep, om2, c, s, step, need,
                 need, need and e is not None)
        torch.library.opcheck(torch.ops.attnopt.px_bwd, bargs)


def test_one_node_under_compile_and_in_the_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, e, m, rep, om2, c, s, sv, step, _ = _arguments(monkeypatch, False, 2.0, True)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnopt.px_fwd(q, k, v, e, m, rep, om2, c, s, sv, step)[0].square().sum()

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v)
    want = fn(q, k, v)
    torch.testing.assert_close(got, want)
    assert any(t.startswith("attnopt.px_fwd") for t in seen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v)), torch.autograd.grad(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, k, v).backward()
    assert {"attnopt::px_fwd", "attnopt::px_bwd"} <= {ev.name for ev in prof.events()}
