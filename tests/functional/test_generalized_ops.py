"""The whole-call generalized C kernels as ``torch.library`` ops (issue 30 item 2):
``attnopt::bsf_fwd`` / ``attnopt::bsf_bwd`` — PyTorch's op checks, the op against the eager
autograd Function (values and gradients, T5's table and ALiBi's offsets), one node under
``torch.compile(fullgraph=True)``, and the op's name in the profiler."""

from __future__ import annotations

import pytest
import torch

from attnopt import _native
from attnopt.functional.generalized import cpu

pytestmark = pytest.mark.skipif(_native.compiler() is None or _native.blas() is None,
                                reason="no C compiler or no BLAS in PyTorch's library")


def _case(kind: int, dtype: torch.dtype = torch.float64, b: int = 2, h: int = 3, nq: int = 5, nk: int = 4):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, 4, generator=g, dtype=dtype).requires_grad_() for n in (nq, nk))
    v = torch.randn(b, h, nk, 3, generator=g, dtype=dtype).requires_grad_()
    if kind == cpu.TABLE:
        src = torch.randn(6, h, generator=g, dtype=dtype).requires_grad_()
        buckets = torch.randint(0, 6, (nq + nk - 1,), generator=g)
    else:
        src, buckets = torch.randn(h, nq + nk - 1, generator=g, dtype=dtype).requires_grad_(), None
    return q, k, v, src, buckets


def _library() -> None:
    lib = _native.library("biased_softmax")
    assert lib is not None
    cpu._fused_functions(lib, torch.float64)


@pytest.mark.parametrize("kind", [cpu.OFFSETS, cpu.TABLE])
def test_opcheck(kind: int) -> None:
    """Schema, fake (meta) implementation, autograd registration, AOT dispatch of both ops."""
    _library()
    q, k, v, src, buckets = _case(kind)
    torch.library.opcheck(torch.ops.attnopt.bsf_fwd, (q, k, v, src, buckets, kind, 0.5))
    out, e, rinv = torch.ops.attnopt.bsf_fwd(*(t.detach() for t in (q, k, v, src)), buckets, kind, 0.5)
    dout = torch.randn_like(out)
    for need in (True, False):
        torch.library.opcheck(torch.ops.attnopt.bsf_bwd,
                              (dout, q.detach(), k.detach(), v.detach(), e, out, rinv, src.detach(), buckets,
                               kind, 0.5, need))


@pytest.mark.parametrize("kind", [cpu.OFFSETS, cpu.TABLE])
def test_op_equals_the_function(kind: int) -> None:
    """The op and the eager autograd Function run the same C calls: equal values and gradients."""
    _library()
    q, k, v, src, buckets = _case(kind)
    want = cpu._FusedBiasedSoftmax.apply(q, k, v, src, buckets, kind, 0.5)
    got = torch.ops.attnopt.bsf_fwd(q, k, v, src, buckets, kind, 0.5)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    dout = torch.randn_like(want)
    gw = torch.autograd.grad(want, (q, k, v, src), dout)
    gg = torch.autograd.grad(got, (q, k, v, src), dout)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.autograd.gradcheck(
        lambda *t: torch.ops.attnopt.bsf_fwd(*t, buckets, kind, 0.5)[0], (q, k, v, src))


def test_one_node_under_compile_and_in_the_profiler() -> None:
    """dynamo records the forward op as one call (fullgraph: no break) and the backward op in the
    backward graph; values and gradients match eager; the profiler names ``attnopt::bsf_*``."""
    _library()
    q, k, v, src, _ = _case(cpu.OFFSETS, torch.float32)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnopt.bsf_fwd(q, k, v, src, None, cpu.OFFSETS, 0.5)[0] * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = compiled(q, k, v, src)
    want = fn(q, k, v, src)
    torch.testing.assert_close(got, want)
    assert any(s.startswith("attnopt.bsf_fwd") for s in seen)
    gg = torch.autograd.grad(got.sum(), (q, k, v, src))
    gw = torch.autograd.grad(want.sum(), (q, k, v, src))
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, k, v, src).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"attnopt::bsf_fwd", "attnopt::bsf_bwd"} <= names


def test_export_sees_the_op() -> None:
    """``torch.export`` of a function that calls the op keeps it as one node."""
    _library()
    q, k, v, src, _ = (t.detach() if isinstance(t, torch.Tensor) else t for t in _case(cpu.OFFSETS))

    class M(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    src: torch.Tensor) -> torch.Tensor:
            return torch.ops.attnopt.bsf_fwd(q, k, v, src, None, cpu.OFFSETS, 0.5)[0]

    ep = torch.export.export(M(), (q, k, v, src))
    assert any("attnopt.bsf_fwd" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(q, k, v, src), M()(q, k, v, src))


def _bs_case(toeplitz: bool, b: int = 2, h: int = 3, nq: int = 5, nk: int = 4):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(b, h, n, 4, generator=g, dtype=torch.float64).requires_grad_() for n in (nq, nk))
    v = torch.randn(b, h, nk, 3, generator=g, dtype=torch.float64).requires_grad_()
    if toeplitz:
        bias = torch.randn(h, nq + nk - 1, generator=g, dtype=torch.float64)
    else:
        bias = torch.randn(1, h, nq, nk, generator=g, dtype=torch.float64)
        bias[0, 0, 1, :2] = float("-inf")  # masked keys
    return q, k, v, bias.requires_grad_()


@pytest.mark.parametrize("toeplitz", [False, True])
def test_chunked_ops_opcheck(toeplitz: bool) -> None:
    """``attnopt::bs_fwd`` / ``bs_bwd`` (the chunked passes): the op checks, with E saved or not."""
    q, k, v, bias = _bs_case(toeplitz)
    torch.library.opcheck(torch.ops.attnopt.bs_fwd, (q, k, v, bias, 0.5, toeplitz, True))
    det = [t.detach() for t in (q, k, v, bias)]
    for need_grad in (True, False):
        out, p, mx, rinv, qs = torch.ops.attnopt.bs_fwd(*det, 0.5, toeplitz, need_grad)
        assert (p.numel() > 0) == need_grad
        for need in (True, False):
            args = (torch.randn_like(out), qs, det[1], det[2], p, out, det[3], mx, rinv, 0.5, toeplitz, need)
            torch.library.opcheck(torch.ops.attnopt.bs_bwd, args)


@pytest.mark.parametrize("toeplitz", [False, True])
def test_chunked_op_equals_the_function(toeplitz: bool) -> None:
    q, k, v, bias = _bs_case(toeplitz)
    want = cpu._NativeBiasedSoftmax.apply(q, k, v, bias, 0.5, toeplitz)
    got = torch.ops.attnopt.bs_fwd(q, k, v, bias, 0.5, toeplitz, True)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    dout = torch.randn_like(want)
    ins = (q, k, v, bias)
    for a, b in zip(torch.autograd.grad(got, ins, dout), torch.autograd.grad(want, ins, dout), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
