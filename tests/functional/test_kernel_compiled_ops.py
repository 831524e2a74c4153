"""The kernel router under ``torch.compile`` and ``torch.export`` (issue 30): a Fourier-feature call that
the eager router runs as the whole call becomes the one op ``attnopt::ffw_fwd`` (backward
``attnopt::ffw_bwd``) in the traced graph, a fused Expsin call ``attnopt::px_fwd`` (``px_bwd``), with
the eager values and gradients; calls outside the whole call's sizes, on meta tensors or before any
eager call found the C library keep the plain ops.

Each test compiles (a few seconds); needs the C library and BLAS (skipped without).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from attnopt.functional.kernel import _fourier_whole, kernel_attention
from attnopt.kernels import NonStationaryFourier, Periodic, RandomFourier
from tests._marks import needs_native
from tests.functional._graphs import Recorder, compiled_equals_eager


def _kernels() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    rff = RandomFourier(RandomFourier.rbf(8, 16, generator=g).spectral_points)
    nsf = NonStationaryFourier.gaussian(8, 16, 0.3, 0.4, generator=g)
    return {"ika_s": rff, "ika_ns": nsf}


def _qkv(b: int = 2, h: int = 3, n: int = 8, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(b, h, n, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _whole_ready() -> None:
    """A skip without the whole call's library / BLAS (no eager call first: the traced router asks
    :func:`attnopt._native.ready` at trace time)."""
    if not _fourier_whole.whole_ready():
        pytest.skip("no C library / BLAS for the whole call")


@needs_native
@pytest.mark.parametrize("name", ["ika_s", "ika_ns"])
@pytest.mark.parametrize("p, masked", [(None, False), (1.5, True), (2.0, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_graph_holds_the_whole_call_op(name: str, p: float | None, masked: bool,
                                                dtype: torch.dtype) -> None:
    _whole_ready()
    kernel = _kernels()[name]
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        mask[0, ..., -3:] = False

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=kernel, magnitude_p=p, attn_mask=mask)

    rec = compiled_equals_eager(fn, tuple(_qkv(dtype=dtype)))
    assert rec.count("attnopt.ffw_fwd") == 1
    assert rec.count("attnopt.ffw_bwd") == 1


@needs_native
def test_points_gradient_through_the_op() -> None:
    """Learnable spectral points (IKA_NS's ``w1``, ``w2`` as leaves): their gradient comes from
    ``ffw_bwd`` and equals eager's."""
    _whole_ready()
    g = torch.Generator().manual_seed(3)
    w1 = (0.3 * torch.randn(8, 16, generator=g)).requires_grad_()
    w2 = (0.4 * torch.randn(8, 16, generator=g)).requires_grad_()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=NonStationaryFourier(w1, w2), magnitude_p=1.5)

    q, k, v = _qkv()
    want = fn(q, k, v)
    rec = Recorder()
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=rec)(q, k, v)
    leaves = (q, k, v, w1, w2)
    for a, b in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves),
                    strict=True):
        torch.testing.assert_close(a, b)
    assert rec.count("attnopt.ffw_fwd") == 1


@needs_native
def test_outside_the_whole_call_keeps_the_plain_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the whole call's size rule the eager router takes the per-pass node (no op yet): the
    traced one the plain ops, no attnopt op in the graph."""
    _whole_ready()
    from attnopt.functional._thresholds import THRESHOLDS

    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 1)
    kernel = _kernels()["ika_s"]
    q, k, v = _qkv()
    rec = Recorder()
    torch._dynamo.reset()
    got = torch.compile(lambda q, k, v: kernel_attention(q, k, v, kernel=kernel), fullgraph=True,
                        backend=rec)(q, k, v)
    torch.testing.assert_close(got, kernel_attention(q, k, v, kernel=kernel))
    assert not any(t.startswith("attnopt.") for t in rec.targets)


class _Attend(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = _kernels()["ika_s"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=self.kernel, magnitude_p=1.5)


@needs_native
def test_export_in_eval_holds_the_op() -> None:
    _whole_ready()
    mod = _Attend().eval()
    q, k, v = (t.detach() for t in _qkv())
    with torch.no_grad():
        want = mod(q, k, v)
        ep = torch.export.export(mod, (q, k, v))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("attnopt.ffw_fwd") for t in targets) == 1
    torch.testing.assert_close(ep.module()(q, k, v), want)


def _periodic_ready() -> None:
    """A skip without the Expsin library (no eager call first, as :func:`_whole_ready`)."""
    from attnopt.functional.kernel import periodic_cpu

    if not periodic_cpu.ready():
        pytest.skip("no C library for the Expsin passes")


@needs_native
@pytest.mark.parametrize("p, masked, causal", [(2.0, False, False), (2.0, True, False), (None, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_expsin_holds_the_px_ops(p: float | None, masked: bool, causal: bool,
                                          dtype: torch.dtype) -> None:
    """Expsin (periodic kernel, L2 magnitude or none; ``p = 1.5``'s magnitude node has a custom jvp
    that dynamo does not trace, on every path) compiles to ``attnopt::px_fwd`` / ``px_bwd``."""
    _periodic_ready()
    kernel = Periodic(2 * math.pi)
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        mask[0, ..., -3:] = False

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=kernel, magnitude_p=p, attn_mask=mask, is_causal=causal)

    rec = compiled_equals_eager(fn, tuple(_qkv(dtype=dtype)))
    assert rec.count("attnopt.px_fwd") == 1
    assert rec.count("attnopt.px_bwd") == 1


@needs_native
def test_export_expsin_in_eval_holds_the_op() -> None:
    _periodic_ready()

    class Expsin(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kernel_attention(q, k, v, kernel=Periodic(2 * math.pi))

    mod = Expsin().eval()
    q, k, v = (t.detach() for t in _qkv())
    with torch.no_grad():
        want = mod(q, k, v)
        ep = torch.export.export(mod, (q, k, v))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("attnopt.px_fwd") for t in targets) == 1
    torch.testing.assert_close(ep.module()(q, k, v), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_noise_is_the_normal_fill_op(dtype: torch.dtype) -> None:
    """The seeded noise traced: one ``attnopt::normal_fill`` node (the C fill at run time, or the mirror
    without the library), bit-equal to eager; export holds it too."""
    from attnopt.functional.kernel.gaussian_noise import draw_seed, noise_from_seed

    seed = draw_seed(torch.Generator().manual_seed(0))
    targets: list[str] = []

    def backend(gm: torch.fx.GraphModule, _: list) -> Callable:
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    got = torch.compile(lambda s: noise_from_seed(s, (2, 3, 5), dtype), fullgraph=True, backend=backend)(seed)
    assert torch.equal(got, noise_from_seed(seed, (2, 3, 5), dtype))
    assert targets == ["attnopt.normal_fill"]

    class Noise(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return noise_from_seed(s, (4, 7), dtype)

    ep = torch.export.export(Noise(), (seed,))
    assert any(str(n.target).startswith("attnopt.normal_fill") for n in ep.graph.nodes)
    assert torch.equal(ep.module()(seed), noise_from_seed(seed, (4, 7), dtype))


@needs_native
@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_compiled_sampled_module_holds_the_sampler_noise_and_attention_ops(variant: str) -> None:
    """The sampled IKAN / MIKAN module traced in training: the spectral sampler ``attnopt::ss_fwd`` /
    ``ss_bwd``, the seeded noise ``attnopt::normal_fill`` and the attention ``attnopt::ffw_fwd`` /
    ``ffw_bwd`` (eager runs the same C in one fused node); values and gradients equal eager's."""
    from attnopt.nn.implicit_kernel import ImplicitKernelAttention

    torch.manual_seed(0)
    mod = ImplicitKernelAttention(32, 4, variant, num_samples=8, p=1.5)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def run(m: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        torch.manual_seed(1)  # the noise is drawn in the forward
        out = m(x, x, x)[0]
        return out, torch.autograd.grad(out.square().sum(), [x, *mod.parameters()])

    want, want_grads = run(mod)
    _whole_ready()
    rec = Recorder()
    torch._dynamo.reset()
    got, got_grads = run(torch.compile(mod, fullgraph=True, backend=rec))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    for op in ("ss_fwd", "ss_bwd", "normal_fill", "ffw_fwd", "ffw_bwd"):
        assert rec.count(f"attnopt.{op}") == 1, op
