"""The kernel router under ``torch.compile`` and ``torch.export`` (issue 30): a Fourier-feature call that
the eager router runs as the whole call becomes the one op ``attnopt::ffw_fwd`` (backward
``attnopt::ffw_bwd``) in the traced graph, one it runs as the per-pass node (above the whole call's
size, or with a key weight given) ``attnopt::ff_fwd`` (``ff_bwd``), a fused Expsin call
``attnopt::px_fwd`` (``px_bwd``), with the eager values and gradients; calls outside the fused node's
sizes, on meta tensors or without the C library keep the plain ops. The ff ops' own checks (opcheck,
gradcheck, equal to the eager Function) are here too.

Each test compiles (a few seconds); needs the C library and BLAS (skipped without). The slow-marked
cases: ``pytest -m slow tests/functional/test_kernel_compiled_ops.py``.
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


def _attention(name: str, p: float | None, masked: bool) -> Callable[..., torch.Tensor]:
    """``kernel_attention`` with the kernel ``name``, magnitude ``p`` and (``masked``) a key mask
    that drops the last three keys of the first batch."""
    kernel = _kernels()[name]
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        mask[0, ..., -3:] = False

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=kernel, magnitude_p=p, attn_mask=mask)

    return fn


@needs_native
@pytest.mark.parametrize("name", ["ika_s", "ika_ns"])
@pytest.mark.parametrize("p, masked", [(None, False), (1.5, True), (2.0, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_graph_holds_the_whole_call_op(name: str, p: float | None, masked: bool,
                                                dtype: torch.dtype) -> None:
    _whole_ready()
    rec = compiled_equals_eager(_attention(name, p, masked), tuple(_qkv(dtype=dtype)))
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
def test_outside_the_fused_node_keeps_the_plain_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the fused node's crossover (``dispatch.CROSSOVERS["kernel"]``) the eager router takes the
    plain ops: the traced one too, no attnopt op in the graph."""
    _whole_ready()
    from attnopt.functional import dispatch

    monkeypatch.setitem(dispatch.CROSSOVERS, "kernel", dict.fromkeys(dispatch.CROSSOVERS["kernel"], 1))
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


# ---- the per-pass node (above the whole call's size): attnopt::ff_fwd / ff_bwd ----


def _ff_ready() -> None:
    """A skip without the per-pass C library (asked as the traced router asks it)."""
    from attnopt.functional.kernel import fourier_cpu

    if not fourier_cpu.ff_ready():
        pytest.skip("no C library for the Fourier-feature passes")


@pytest.fixture
def per_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole call off (``kernel_wholecall_below`` 1): the eager router runs the per-pass node."""
    from attnopt.functional._thresholds import THRESHOLDS

    _ff_ready()
    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 1)


_PER_PASS = [("ika_s", 1.5, True, torch.float32), ("ika_ns", 1.0, False, torch.float64)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in
    [("ika_s", None, False, torch.float64), ("ika_ns", 1.5, True, torch.float32),
     ("ika_s", 2.0, True, torch.float64), ("ika_ns", None, True, torch.float32)]
]


@needs_native
@pytest.mark.parametrize(("name", "p", "masked", "dtype"), _PER_PASS)
def test_compiled_graph_holds_the_per_pass_op(per_pass: None, name: str, p: float | None, masked: bool,
                                              dtype: torch.dtype) -> None:
    """Above the whole call's size a traced call is ``attnopt::ff_fwd`` / ``ff_bwd`` (the eager
    router's :class:`_FusedFourier`), with eager's values and gradients (slow-marked cases:
    ``pytest -m slow -k per_pass``)."""
    rec = compiled_equals_eager(_attention(name, p, masked), tuple(_qkv(dtype=dtype)))
    assert (rec.count("attnopt.ff_fwd"), rec.count("attnopt.ff_bwd")) == (1, 1)
    assert rec.count("attnopt.ffw_") == 0


@needs_native
def test_per_pass_op_other_lengths_and_learned_points(per_pass: None) -> None:
    """``Nq != Nk`` (``[Q; K]`` concatenated, not stacked) and learnable points per head (IKA_NS's
    ``w1``, ``w2`` of shape (H, R, d)): the op's gradients of q, k, v and the points equal eager's."""
    g = torch.Generator().manual_seed(3)
    w1 = (0.3 * torch.randn(3, 8, 16, generator=g)).requires_grad_()
    w2 = (0.4 * torch.randn(3, 8, 16, generator=g)).requires_grad_()
    q = torch.randn(2, 3, 5, 16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 3, 9, 16, generator=g).requires_grad_() for _ in range(2))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=NonStationaryFourier(w1, w2), magnitude_p=1.5)

    want = fn(q, k, v)
    rec = Recorder()
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=rec)(q, k, v)
    torch.testing.assert_close(got, want)
    leaves = (q, k, v, w1, w2)
    for a, b in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves),
                    strict=True):
        torch.testing.assert_close(a, b)
    assert (rec.count("attnopt.ff_fwd"), rec.count("attnopt.ff_bwd")) == (1, 1)


@needs_native
def test_given_key_weight_is_the_per_pass_op() -> None:
    """A magnitude outside ``[1, 2]`` (p = 3): the eager router computes the key weight with plain ops
    and gives it to the node (:func:`fused_fourier_attention`); traced, the op with the weight as an
    input, its gradient flowing back into the magnitude's ops."""
    _ff_ready()
    kernel = _kernels()["ika_s"]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_attention(q, k, v, kernel=kernel, magnitude_p=3.0)

    rec = compiled_equals_eager(fn, tuple(_qkv(dtype=torch.float64)))
    assert (rec.count("attnopt.ff_fwd"), rec.count("attnopt.ff_bwd")) == (1, 1)


@needs_native
@pytest.mark.parametrize("variant, p", [("ikan", 1.5), pytest.param("ikan", 1.0, marks=pytest.mark.slow),
                                        pytest.param("ika-s", None, marks=pytest.mark.slow)])
def test_compiled_module_above_the_whole_call_holds_the_per_pass_op(per_pass: None, variant: str,
                                                                    p: float | None) -> None:
    """The IKA / IKAN modules above the whole call's size (eager: the sampler's node, then the per-pass
    node): compiled fullgraph in training, ``attnopt::ff_fwd`` / ``ff_bwd`` in the graphs and eager's
    values and gradients of the input and every parameter."""
    from attnopt.nn.implicit_kernel import ImplicitKernelAttention

    torch.manual_seed(0)
    options = {} if p is None else {"p": p}
    mod = ImplicitKernelAttention(32, 4, variant, num_samples=8, **options)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def run(m: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        torch.manual_seed(1)  # the noise is drawn in the forward
        out = m(x, x, x)[0]
        return out, torch.autograd.grad(out.square().sum(), [x, *mod.parameters()])

    want, want_grads = run(mod)
    rec = Recorder()
    torch._dynamo.reset()
    got, got_grads = run(torch.compile(mod, fullgraph=True, backend=rec))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert (rec.count("attnopt.ff_fwd"), rec.count("attnopt.ff_bwd")) == (1, 1)


@needs_native
def test_export_in_eval_holds_the_per_pass_op(per_pass: None) -> None:
    mod = _Attend().eval()
    q, k, v = (t.detach() for t in _qkv())
    with torch.no_grad():
        want = mod(q, k, v)
        ep = torch.export.export(mod, (q, k, v))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("attnopt.ff_fwd") for t in targets) == 1
    torch.testing.assert_close(ep.module()(q, k, v), want)


def _ff_case(nq: int, nk: int, points: tuple[int, ...], p: float | None, masked: bool, weighted: bool,
             dtype: torch.dtype = torch.float64) -> tuple:
    g = torch.Generator().manual_seed(4)
    b, h, d = 2, 3, 4
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, h, nk, 5, generator=g, dtype=dtype).requires_grad_()
    pts = (0.7 * torch.randn(*points, 6, d, generator=g, dtype=dtype)).requires_grad_()
    mask = None
    if masked:
        mask = torch.zeros(b, h, nk, dtype=dtype)
        mask[0, 1, 2:] = float("-inf")
    kw = torch.rand(b, h, nk, 1, generator=g, dtype=dtype).add_(0.1).requires_grad_() if weighted else None
    return (q, k, v, pts, kw, mask, 1e-3, 1 / (2 * math.sqrt(3)), 2, p, 0.6, True)


_FF_CASES = [(6, 6, (), 1.5, True, False), (5, 7, (2, 3), None, False, False),
             (6, 6, (3,), 2.0, False, False), (5, 5, (), None, False, True), (4, 6, (), 1.0, True, False)]
#: (a few seconds each: two in the default run, the rest with -m slow)
_FF_PARAMS = [(*case, blocked) if (i, blocked) in ((0, False), (1, True))
              else pytest.param(*case, blocked, marks=pytest.mark.slow)
              for i, case in enumerate(_FF_CASES) for blocked in (False, True)]


@needs_native
@pytest.mark.parametrize(("nq", "nk", "points", "p", "masked", "weighted", "blocked"), _FF_PARAMS)
def test_ff_opcheck_and_equal_to_the_function(monkeypatch: pytest.MonkeyPatch, nq: int, nk: int,
                                              points: tuple[int, ...], p: float | None, masked: bool,
                                              weighted: bool, blocked: bool) -> None:
    """``torch.library.opcheck`` of ``ff_fwd`` (schema, fake, autograd registration, AOT) and
    ``ff_bwd``, and the op bitwise equal to the eager :class:`_FusedFourier` (values and gradients of
    q, k, v, the points and a given key weight): stacked / concatenated ``[Q; K]``, shared / per-head
    points, the L^p magnitude, a key mask, a given weight; ``blocked``: ``F``, ``W`` not kept (the
    backward recomputes them by blocks)."""
    _ff_ready()
    from attnopt.functional._thresholds import THRESHOLDS
    from attnopt.functional.kernel.fourier import _FusedFourier

    if blocked:
        monkeypatch.setattr(THRESHOLDS, "kernel_whole_elements", 8)
        monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 16)
    args = _ff_case(nq, nk, points, p, masked, weighted)
    torch.library.opcheck(torch.ops.attnopt.ff_fwd.default, args)
    outs = torch.ops.attnopt.ff_fwd(*args)
    assert (outs[9].dim() == 3) is not blocked  # F kept or not
    want = _FusedFourier.apply(*args[:-1])
    assert torch.equal(outs[0], want)
    leaves = [t for t in args[:5] if t is not None]
    dout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(outs[0], leaves, dout), torch.autograd.grad(want, leaves, dout),
                    strict=True):
        assert torch.equal(a, b)
    det = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    outs = torch.ops.attnopt.ff_fwd(*det)
    saved = (*outs[1:7], outs[0], *outs[7:])
    for need in (True, False):
        bargs = (torch.randn_like(outs[0]), *det[:5], *saved, *det[6:9], need, True, need, True,
                 need and weighted)
        torch.library.opcheck(torch.ops.attnopt.ff_bwd.default, bargs)


@needs_native
@pytest.mark.parametrize(("p", "weighted"), [(1.5, False), (None, True)])
def test_ff_op_gradcheck(p: float | None, weighted: bool) -> None:
    """float64 ``gradcheck`` of a function calling ``torch.ops.attnopt.ff_fwd`` directly: ``ff_bwd``'s
    gradients of q, k, v, the points (per head) and a given key weight against finite differences."""
    _ff_ready()
    args = _ff_case(4, 5, (3,), p, p is not None, weighted)
    leaves = tuple(t for t in args[:5] if t is not None)

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        q, k, v, pts = xs[:4]
        kw = xs[4] if weighted else None
        return torch.ops.attnopt.ff_fwd(q, k, v, pts, kw, *args[5:])[0]

    assert torch.autograd.gradcheck(fn, leaves, atol=1e-6, rtol=1e-5)


@needs_native
def test_ff_op_without_the_c_library_runs_the_pytorch_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph holding ``ff_fwd`` run where the C passes are missing: the op's body takes the PyTorch
    ops (inside the op, no branch in the graph), same values and gradients to rounding."""
    _ff_ready()
    from attnopt.functional.kernel import _fourier_pass

    args = _ff_case(6, 6, (3,), 1.5, True, False)
    leaves = args[:4]

    def run() -> tuple[torch.Tensor, ...]:
        out = torch.ops.attnopt.ff_fwd(*args)[0]
        return (out, *torch.autograd.grad(out.square().sum(), leaves))

    want = run()
    monkeypatch.setattr(_fourier_pass, "_fns", lambda x: None)
    for a, b in zip(run(), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p", [1.0, 1.5])
def test_expsin_lp_magnitude_compiles_fullgraph(p: float) -> None:
    """The L^p key magnitude (1 <= p < 2) of the periodic kernel: eager runs a Function with a
    custom ``jvp`` (which dynamo cannot trace); traced, the same function in plain ops — no graph
    break, eager's values and gradients, also with zero key entries (gradient 0 there)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 0, 3] = 0.0
    k[0, 1, 4, :3] = 0.0
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    periodic = Periodic(2 * math.pi)
    compiled_equals_eager(lambda q, k, v: kernel_attention(q, k, v, kernel=periodic, magnitude_p=p), leaves)
