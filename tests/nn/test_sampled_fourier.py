"""The one-node path of the sampled implicit-kernel modules (``nn/_sampled_fourier.py``): the same
outputs, KL, random stream and every gradient as the two-node path (sampler node, then attention),
bitwise; gradcheck in float64; the conditions under which it steps aside; its errors."""
from __future__ import annotations

import pytest
import torch

import attnopt.nn.implicit_kernel as ik
from attnopt import _native
from attnopt.functional.kernel import sampled_fourier as _sampled_fourier
from attnopt.nn.implicit_kernel import ImplicitKernelAttention

pytestmark = pytest.mark.skipif(
    _native.compiler() is None or _native.blas() is None, reason="no C compiler or no BLAS found")


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)


def _count(monkeypatch) -> list[int]:
    calls = [0]
    apply = _sampled_fourier._apply

    def counted(*args):
        calls[0] += 1
        return apply(*args)

    monkeypatch.setattr(_sampled_fourier, "_apply", counted)
    return calls


def _run(variant, dtype, training, one_node, monkeypatch, steps=2, seed=3, transposed=False):
    """Two steps (the random stream goes on between them); outputs, KLs and every gradient."""
    with monkeypatch.context() as m:
        if not one_node:
            m.setattr(ik, "sampled_fourier_attention", lambda *a, **k: None)
        p = 2.0 if variant in ("ika-s", "ika-ns") else 1.5
        torch.manual_seed(seed)  # the networks' first layers start from the global generator
        mod = ImplicitKernelAttention(32, 4, variant, num_samples=6, p=p, seed=seed, hidden=5).to(dtype)
        with torch.no_grad():  # move the networks off their zero initialization
            for par in mod.parameters():
                par.add_(0.3 * torch.randn(par.shape, generator=torch.Generator().manual_seed(par.numel()),
                                           dtype=dtype))
        mod.train(training)
        g = torch.Generator().manual_seed(seed)
        got = []
        for _ in range(steps):
            if transposed:  # heads as a projection gives them: (B, N, H, d) viewed as (B, H, N, d)
                q, k, v = (torch.randn(2, 7, 4, 8, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
                           for _ in range(3))
            else:
                q, k, v = (torch.randn(2, 4, 7, 8, generator=g, dtype=dtype).requires_grad_()
                           for _ in range(3))
            out, _ = mod.attend(q, k, v, None, False, False)
            kl = mod.kl()
            gout = torch.randn(out.shape, generator=g, dtype=dtype)
            own = [*mod.densities.parameters(), *(mod.copula.parameters() if mod.copula is not None else ())]
            leaves = [q, k, v, *own]
            grads = torch.autograd.grad((out, kl), leaves, (gout, torch.tensor(0.7, dtype=dtype)))
            got.append((out, kl, *grads))
        return got


@pytest.mark.parametrize("variant", ["ika-s", "ika-ns", "ikan", "mikan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_one_node_is_the_two_node_path_bitwise(variant, dtype, training, monkeypatch):
    calls = _count(monkeypatch)
    one = _run(variant, dtype, training, True, monkeypatch)
    assert calls[0] == 2  # the one-node path ran, once a step
    two = _run(variant, dtype, training, False, monkeypatch)
    assert calls[0] == 2
    for step_one, step_two in zip(one, two, strict=True):
        for a, b in zip(step_one, step_two, strict=True):
            assert torch.equal(a, b)


def test_one_node_with_transposed_heads(monkeypatch):
    one = _run("mikan", torch.float32, True, True, monkeypatch, transposed=True)
    two = _run("mikan", torch.float32, True, False, monkeypatch, transposed=True)
    for step_one, step_two in zip(one, two, strict=True):
        for a, b in zip(step_one, step_two, strict=True):
            assert torch.equal(a, b)


def test_gradcheck_through_the_module():
    """float64, evaluation noise (fixed), off-initialization networks: q, k, v (the parameters'
    gradients are the two-node path's, bitwise, above, which the sampler's tests gradcheck)."""
    mod = ImplicitKernelAttention(12, 2, "mikan", num_samples=4, p=1.5, seed=1, hidden=3).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for par in mod.parameters():
            par.add_(0.2 * torch.randn(par.shape, generator=g, dtype=torch.float64))
    q, k, v = (torch.randn(1, 2, 5, 6, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))

    def f(q, k, v):
        out, _ = mod.attend(q, k, v, None, False, False)
        return out, mod.kl()

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_steps_aside(monkeypatch):
    """A key mask, need_weights, the linear mode, ikan-direct: the two-node path (no one-node call)."""
    calls = _count(monkeypatch)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mod = ImplicitKernelAttention(32, 4, "ikan", num_samples=4, p=1.5, seed=0)
    mask = torch.zeros(2, 1, 1, 5)
    mask[..., -1] = float("-inf")
    mod.attend(q, k, v, mask, False, False)
    mod.attend(q, k, v, None, False, True)
    mod.attend(q, k, v, None, True, False)
    linear = ImplicitKernelAttention(32, 4, "ikan", num_samples=4, p=1.5, mode="linear")
    linear.attend(q, k, v, None, False, False)
    ImplicitKernelAttention(32, 4, "ikan-direct", num_samples=4, p=1.5).attend(q, k, v, None, False, False)
    assert calls[0] == 0
    mod.attend(q, k, v, None, False, False)
    assert calls[0] == 1


def test_errors():
    mod = ImplicitKernelAttention(32, 4, "ikan", num_samples=4, p=1.5, seed=0)
    q, k, v = (torch.randn(1, 4, 5, 8, requires_grad=True) for _ in range(3))
    bad = q.detach().clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q"):
        mod.attend(bad, k, v, None, False, False)
    out, _ = mod.attend(q, k, v, None, False, False)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    with torch.no_grad():
        mod.densities[0].nn2[2].bias.fill_(float("inf"))  # points of infinite size
    with pytest.raises(ValueError, match="spectral points must be finite"):
        mod.attend(q, k, v, None, False, False)


def test_no_reference_cycle_and_a_retained_graph_runs_twice():
    """The node's context holds no output (no out -> ctx -> out cycle, freed without the garbage
    collector); with retain_graph the backward runs again and gives the same gradients."""
    import gc
    import weakref

    mod = ImplicitKernelAttention(32, 4, "ikan", num_samples=4, p=1.5, seed=0)
    q, k, v = (torch.randn(1, 4, 5, 8, requires_grad=True) for _ in range(3))
    gc.disable()
    try:
        out, _ = mod.attend(q, k, v, None, False, False)
        assert type(out.grad_fn).__name__ == "_SampledFourierBackward"
        first = torch.autograd.grad(out.sum(), (q, k), retain_graph=True)
        second = torch.autograd.grad(out.sum(), (q, k))
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        ref = weakref.ref(out)
        del out
        mod._kl = None
        assert ref() is None
    finally:
        gc.enable()


def test_two_threads_split_the_heads_and_agree_bitwise(monkeypatch):
    """B·H·N² = 2¹⁶ scores on two torch threads: the attention's C calls split the heads over two
    threads (the plan says so); outputs, KL and gradients are the two-node path's, bitwise."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = []
        for one_node in (True, False):
            with monkeypatch.context() as m:
                if not one_node:
                    m.setattr(ik, "sampled_fourier_attention", lambda *a, **k: None)
                _sampled_fourier._PLANS.clear()
                torch.manual_seed(1)  # the networks' first layers start from the global generator
                mod = ImplicitKernelAttention(64, 8, "mikan", num_samples=4, p=1.5, seed=2, hidden=5)
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(2, 8, 64, 8, generator=g).requires_grad_() for _ in range(3))
                out, _ = mod.attend(q, k, v, None, False, False)
                own = [*mod.densities.parameters(), *mod.copula.parameters()]
                grads = torch.autograd.grad(torch.add(out.sum(), mod.kl(), alpha=0.5), [q, k, v, *own])
                got.append((out, mod.kl(), *grads))
                if one_node:
                    assert [plan.threads for plan in _sampled_fourier._PLANS.values()] == [2]
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_a_seen_call_still_checks_what_can_change_between_calls(monkeypatch):
    """The second call of a shape takes the plan by its key but checks the per-call state again:
    a parameter made non-contiguous in place (``p.data = ...`` keeps the object), the native
    switch, a dispatch mode, a crossover changed to stream, another build of the libraries —
    each sends the call to the two-node path (no one-node call), and back once it is undone."""
    from torch.utils.flop_counter import FlopCounterMode

    from attnopt.functional import dispatch

    calls = _count(monkeypatch)
    mod = ImplicitKernelAttention(32, 4, "mikan", num_samples=4, p=1.5, seed=0)
    q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))

    def one_node_calls() -> int:
        before = calls[0]
        out, _ = mod.attend(q, k, v, None, False, False)
        torch.add(out.sum(), mod.kl()).backward()
        assert torch.isfinite(out).all()
        return calls[0] - before

    assert one_node_calls() == 1 and one_node_calls() == 1
    weight = mod.densities[1].nn2[0].weight
    kept = weight.data
    weight.data = kept.t().contiguous().t()  # same shape and values, column-major
    assert one_node_calls() == 0
    weight.data = kept
    assert one_node_calls() == 1
    with monkeypatch.context() as m:
        m.setenv("ATTNOPT_NATIVE", "0")
        assert one_node_calls() == 0
    with FlopCounterMode(display=False):
        assert one_node_calls() == 0
    with monkeypatch.context() as m:
        m.setitem(dispatch.CROSSOVERS["kernel"], "float32", 0)
        assert one_node_calls() == 0
    plans = []
    counted = _sampled_fourier._apply
    monkeypatch.setattr(_sampled_fourier, "_apply", lambda *a: plans.append(a[5]) or counted(*a))
    with monkeypatch.context() as m:  # another build of the libraries: its plan, not the old one's
        m.setattr(_native, "_LIBS", {})
        assert one_node_calls() == 1
        assert plans[-1].libs == (_native._LIBS["spectral_sample"], _native._LIBS["fourier_features"])
    assert one_node_calls() == 1
    assert plans[-1].libs == (_native._LIBS["spectral_sample"], _native._LIBS["fourier_features"])
    assert plans[-1] is not plans[0]
