"""The C spectral sampler as ``torch.library`` ops (issue 30 item 2): ``attnopt::ss_fwd`` /
``attnopt::ss_bwd`` — PyTorch's op checks, the op against the eager autograd Function (values and
every gradient: summary or keys, noise, the copula's raw, each parameter), one node under
``torch.compile(fullgraph=True)``, and the op's name in the profiler."""
from __future__ import annotations

import pytest
import torch

import attnopt.functional.kernel.spectral as sf
from attnopt import _native
from attnopt.functional.kernel import spectral_cpu as sn
from tests.nn.test_spectral_fused import _densities

pytestmark = pytest.mark.skipif(_native.compiler() is None, reason="no C compiler on this machine")
F64 = torch.float64


def _case(copula: bool, keys: bool):
    g = torch.Generator().manual_seed(3)
    n_sets, lead, d, half = 2, (2, 3), 3, 2
    dens = _densities(n_sets, d=d, r=2 * half, hidden=5, scales=[0.3, 0.5])
    src = torch.randn(*lead, 4, d, generator=g, dtype=F64) if keys else torch.randn(*lead, d, generator=g,
                                                                                     dtype=F64)
    noise = torch.randn(n_sets, *lead, half, d, generator=g, dtype=F64).requires_grad_()
    raw = torch.randn(lead[-1], lead[-1], generator=g, dtype=F64).requires_grad_() if copula else None
    params = sf.fusable(dens)
    assert params is not None and sn.library(src, noise, raw, params, keys=keys) is not None
    return src.requires_grad_(), noise, raw, params, [float(m.base_scale) for m in dens]


@pytest.mark.parametrize(("copula", "keys", "kl_mean"), [(False, False, False), (True, False, True),
                                                          (True, True, False)])
def test_opcheck(copula: bool, keys: bool, kl_mean: bool) -> None:
    src, noise, raw, params, scales = _case(copula, keys)
    torch.library.opcheck(torch.ops.attnopt.ss_fwd, (src, noise, raw, params, scales, kl_mean, keys))
    det = [t.detach() for t in params]
    s, n, r = src.detach(), noise.detach(), None if raw is None else raw.detach()
    pts, kl, ws, h = torch.ops.attnopt.ss_fwd(s, n, r, det, scales, kl_mean, keys)
    for need in (True, False):
        args = (torch.randn_like(pts), torch.randn_like(kl), s, h, n, r, ws, det, scales, kl_mean, keys, need,
                need, need)
        torch.library.opcheck(torch.ops.attnopt.ss_bwd, args)


@pytest.mark.parametrize(("copula", "keys", "kl_mean"), [(False, False, False), (True, True, True)])
def test_op_equals_the_function(copula: bool, keys: bool, kl_mean: bool) -> None:
    src, noise, raw, params, scales = _case(copula, keys)
    want = sn._NativeSpectralSample.apply(src, noise, raw, tuple(scales), kl_mean, keys, *params)
    got = torch.ops.attnopt.ss_fwd(src, noise, raw, params, scales, kl_mean, keys)[:2]
    leaves = (src, noise, *((raw,) if copula else ()), *params)
    grads = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(got, leaves, grads), torch.autograd.grad(want, leaves, grads),
                    strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_one_node_under_compile_and_in_the_profiler() -> None:
    src, noise, raw, params, scales = _case(True, False)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(src: torch.Tensor, noise: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        pts, kl = torch.ops.attnopt.ss_fwd(src, noise, raw, params, scales, False, False)[:2]
        return pts.square().sum() + kl.sum()

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(src, noise, raw)
    want = fn(src, noise, raw)
    torch.testing.assert_close(got, want)
    assert any(s.startswith("attnopt.ss_fwd") for s in seen)
    for a, b in zip(torch.autograd.grad(got, (src, noise, raw)), torch.autograd.grad(want, (src, noise, raw)),
                    strict=True):
        torch.testing.assert_close(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(src, noise, raw).backward()
    assert {"attnopt::ss_fwd", "attnopt::ss_bwd"} <= {e.name for e in prof.events()}
