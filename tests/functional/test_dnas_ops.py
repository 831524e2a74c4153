"""The DNAS / HNAS C passes as ``torch.library`` ops (issue 30 item 2): ``attnopt::dn_fwd`` /
``attnopt::dn_bwd`` — PyTorch's op checks, the op against the eager autograd Function (values and
gradients, DNAS and HNAS, key-only / full masks, causal), one node under
``torch.compile(fullgraph=True)``, and the op's name in the profiler."""

from __future__ import annotations

import pytest
import torch

from attnopt import _native
from attnopt.functional.doubly_normalized import cpu
from tests._marks import needs_native

pytestmark = needs_native


def _case(hnas: bool, mask: str | None, b: int = 2, h: int = 2, nq: int = 5, nk: int = 6):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, 4, generator=g).requires_grad_() for n in (nq, nk))
    v = torch.randn(b, h, nk, 3, generator=g).requires_grad_()
    w = torch.full((1, h, 1, 1), 0.7).requires_grad_() if hnas else None
    m = None
    if mask == "key":
        m = torch.zeros(b, 1, 1, nk)
        m[0, ..., -1] = float("-inf")
    elif mask == "full":
        m = 0.1 * torch.randn(1, 1, nq, nk, generator=g)
    return q, k, v, w, m


CASES = [(False, None, False), (True, None, False), (False, "key", False), (True, "full", False),
         (False, None, True)]


@pytest.mark.parametrize(("hnas", "mask", "causal"), CASES)
def test_opcheck(hnas: bool, mask: str | None, causal: bool) -> None:
    """Schema, fake (meta) implementation, autograd registration, AOT dispatch of both ops."""
    assert _native.library("dnas") is not None
    q, k, v, w, m = _case(hnas, mask)
    torch.library.opcheck(torch.ops.attnopt.dn_fwd, (q, k, v, w, m, causal, 0.5))
    det = [t.detach() for t in (q, k, v)]
    w = None if w is None else w.detach()
    out, mx, beta, u, alpha, binv, ok = torch.ops.attnopt.dn_fwd(*det, w, m, causal, 0.5)
    assert bool(ok)
    for need in (True, False):
        args = (torch.randn_like(out), *det, w, m, mx, beta, u, alpha, binv, ok, causal, 0.5, need)
        torch.library.opcheck(torch.ops.attnopt.dn_bwd, args)


@pytest.mark.parametrize(("hnas", "mask", "causal"), CASES)
def test_op_equals_the_function(hnas: bool, mask: str | None, causal: bool) -> None:
    """The op and the eager autograd Function run the same C calls: equal values and gradients."""
    q, k, v, w, m = _case(hnas, mask)
    ins = [t for t in (q, k, v, w) if t is not None]
    want = cpu._NativeSinkhorn.apply(q, k, v, w, m, causal, 0.5, 1, [True])
    got = torch.ops.attnopt.dn_fwd(q, k, v, w, m, causal, 0.5)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    dout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, ins, dout), torch.autograd.grad(want, ins, dout), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


SINKHORN = [(2, None, False), (3, "key", False), (3, "full", True), (5, None, True)]


@pytest.mark.parametrize(("iterations", "mask", "causal"), SINKHORN)
def test_sinkhorn_k_op_check_and_reference(iterations: int, mask: str | None, causal: bool) -> None:
    """Sinkhorn-K (K >= 2) through the same ops (``sk_fwd`` / ``sk_bwd`` of ``_native/dnas.c``):
    PyTorch's op checks, and values and gradients of the float64 log-domain reference to float32
    rounding; the eager Function gives the op's numbers bitwise."""
    from attnopt.functional.doubly_normalized import reference

    q, k, v, _, m = _case(False, mask, nq=6, nk=6)
    torch.library.opcheck(torch.ops.attnopt.dn_fwd, (q, k, v, None, m, causal, 0.5, iterations))
    got = torch.ops.attnopt.dn_fwd(q, k, v, None, m, causal, 0.5, iterations)[0]
    fn = cpu._NativeSinkhorn.apply(q, k, v, None, m, causal, 0.5, iterations, [True])
    torch.testing.assert_close(got, fn, atol=0, rtol=0)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*x64, iterations, None, None if m is None else m.double(), 0.5, causal)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    gw = torch.autograd.grad(want, x64, dout)
    gg = torch.autograd.grad(got, (q, k, v), dout.float(), retain_graph=True)
    gf = torch.autograd.grad(fn, (q, k, v), dout.float())
    for a, b, c in zip(gg, gw, gf, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-6, rtol=5e-6)
        torch.testing.assert_close(a, c, atol=0, rtol=0)


def test_underflow_is_reported_not_hidden() -> None:
    """A dominated row underflows its normalizer: ``ok`` is False (the router falls back)."""
    q, k, v, _, _ = _case(False, None)
    q = q.detach().clone()
    q[0, 0, 0] = 400.0  # scores of one row far above every column's other entries
    k = k.detach().clone()
    k[0, 0] = k[0, 0].abs()
    ok = torch.ops.attnopt.dn_fwd(q, k, v.detach(), None, None, False, 1.0)[-1]
    want = cpu._NativeSinkhorn.apply(q, k, v.detach(), None, None, False, 1.0, 1, info := [True])
    assert bool(ok) == info[0]
    assert want.numel() == 0 or info[0]


def test_one_node_under_compile_and_in_the_profiler() -> None:
    """dynamo records the forward op as one call (fullgraph) and the backward op in the backward
    graph; values and gradients match eager; the profiler names ``attnopt::dn_*``."""
    q, k, v, w, _ = _case(True, None)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnopt.dn_fwd(q, k, v, w, None, False, 0.5)[0] * 2

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v, w)
    want = fn(q, k, v, w)
    torch.testing.assert_close(got, want)
    assert any(s.startswith("attnopt.dn_fwd") for s in seen)
    ins = (q, k, v, w)
    for a, b in zip(torch.autograd.grad(got.sum(), ins), torch.autograd.grad(want.sum(), ins), strict=True):
        torch.testing.assert_close(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, k, v, w).sum().backward()
    assert {"attnopt::dn_fwd", "attnopt::dn_bwd"} <= {e.name for e in prof.events()}


def test_sinkhorn_k_c_path_fully_masked_row_and_dead_key() -> None:
    """Through the router on the C passes (``dnas_native_min_entries`` 0), K = 3: a query with no
    admissible key gets zeros, a key no query sees weight 0; values and gradients finite and equal
    to the reference's."""
    import attnopt
    from attnopt.functional import dispatch
    from attnopt.functional._thresholds import overrides

    q, k, v, _, _ = _case(False, None, nq=6, nk=6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[0, :, 2, :] = False
    mask[1, :, :, 4] = False
    with overrides(dnas_native_min_entries=0):
        got = attnopt.doubly_normalized_attention(q, k, v, iterations=3, attn_mask=mask)
        assert dispatch.last_dispatch["sinkhorn"] == "materialized"
        grads = torch.autograd.grad(got.sum(), (q, k, v))
    with attnopt.backend("reference"):
        want = attnopt.doubly_normalized_attention(q, k, v, iterations=3, attn_mask=mask)
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert torch.all(got[0, :, 2] == 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for a, b in zip(grads, want_grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=5e-6, rtol=5e-6)
