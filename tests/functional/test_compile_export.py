"""Acceptance of issue 30: compile, export, meta and a fake device for every registry module.

* ``torch.compile(module, fullgraph=True)`` (no graph break) matches eager, values and
  gradients, for every registry module but ``mem`` (its Newton solver stops on a host-read
  convergence test, by design);
* ``torch.export.export`` of every registry module in eval mode matches eager;
* forward + backward on the meta device, with an aten op count that does not depend on B·H;
* a fake accelerator (:mod:`tests.functional._fake_device`: CPU memory behind PyTorch's
  PrivateUse1 Python backend) runs every module and public op: no host sync, no C kernel handed
  a device tensor (its ``data_ptr`` raises), op counts independent of B·H, the CPU's values.

Default run: a few modules per check; ``pytest -m slow tests/functional/test_compile_export.py``
runs all of them (a few minutes: dynamo traces each module).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnopt.functional as F
from attnopt.functional.regularized.regularizers import Shannon, SquaredL2, Tsallis
from attnopt.kernels import RBF, Linear, Periodic
from attnopt.nn.registry import attention_names, make_attention
from tests.functional import _fake_device as fd

# the fake device is set up at collection, before any backward: the autograd engine sizes its
# per-device queues once, at the first backward of the process
fd.device()

NAMES = [n for n in attention_names() if n != "mem"]
FAST_COMPILE = {"sparsemax"}
FAST_EXPORT = {"t5"}


def _marked(names: list[str], fast: set[str]) -> list:
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


def _call(name: str, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if name == "ot":
        bank = torch.ones(x.shape[0], 4, x.shape[-1], device=x.device, dtype=x.dtype)
        return module(x, bank=bank)[0]
    return module(x)[0]


def _eager(name: str, module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    torch.manual_seed(1)  # the sampled kernels draw their noise in the forward
    out = _call(name, module, x)
    grads = torch.autograd.grad(out.square().sum(), [x, *module.parameters()], allow_unused=True)
    return out.detach(), [None if g is None else g.detach() for g in grads]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", _marked(NAMES, FAST_COMPILE))
def test_compile_fullgraph_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    module = make_attention(name, 16, 2)
    x = torch.randn(2, 12, 16, requires_grad=True)
    out, grads = _eager(name, module, x)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    got, got_grads = _eager(name, compiled, x)
    _close(got, out)
    for a, b in zip(got_grads, grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dnas", "sparsemax", "t5"])
def test_compile_inductor_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    module = make_attention(name, 16, 2)
    x = torch.randn(2, 12, 16, requires_grad=True)
    out, grads = _eager(name, module, x)
    torch._dynamo.reset()
    got, got_grads = _eager(name, torch.compile(module, fullgraph=True), x)
    _close(got, out)
    for a, b in zip(got_grads, grads, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class _Wrapped(torch.nn.Module):
    def __init__(self, name: str, module: torch.nn.Module) -> None:
        super().__init__()
        self.name, self.module = name, module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _call(self.name, self.module, x)


@pytest.mark.parametrize("name", _marked(NAMES, FAST_EXPORT))
def test_export_eval_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    module = _Wrapped(name, make_attention(name, 16, 2)).eval()
    x = torch.randn(2, 12, 16)
    program = torch.export.export(module, (x,))
    with torch.no_grad():
        _close(program.module()(x), module(x))
        y = torch.randn(2, 12, 16)  # another input of the exported shape
        _close(program.module()(y), module(y))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def _count(name: str, device: torch.device | str, b: int, h: int) -> collections.Counter:
    torch.manual_seed(0)
    module = make_attention(name, 8 * h, h).to(device)
    x = torch.randn(b, 24, 8 * h, device=device, requires_grad=True)
    with _CountOps() as mode:
        _call(name, module, x).sum().backward()
    return mode.ops


@pytest.mark.parametrize("name", NAMES)
def test_meta_forward_backward_op_count_independent_of_batch_heads(name: str) -> None:
    small, large = _count(name, "meta", 2, 2), _count(name, "meta", 4, 8)
    assert sum(small.values()) > 0
    assert small == large, {
        k: (small[k], large[k]) for k in small.keys() | large.keys() if small[k] != large[k]
    }


@pytest.fixture
def fake_device() -> torch.device:
    dev = fd.device()
    with fd.direct_checkpoint():
        yield dev


def _on_device(
    name: str, dev: torch.device, b: int, h: int
) -> tuple[collections.Counter, torch.Tensor, list]:
    torch.manual_seed(0)
    module = make_attention(name, 8 * h, h)
    cpu_x = torch.randn(b, 24, 8 * h)
    module_dev = make_attention(name, 8 * h, h).to(dev)
    module_dev.load_state_dict(module.state_dict())
    x = fd.to_device(cpu_x).requires_grad_()
    with fd.counting() as counts:
        torch.manual_seed(1)
        out = _call(name, module_dev, x)
        grads = torch.autograd.grad(out.square().sum(), [x, *module_dev.parameters()], allow_unused=True)
    assert out.device.type == fd.NAME
    return counts, fd.to_cpu(out), [None if g is None else fd.to_cpu(g) for g in grads]


@pytest.mark.parametrize("name", NAMES)
def test_fake_device_modules_no_sync_constant_ops(name: str, fake_device: torch.device) -> None:
    small, _, _ = _on_device(name, fake_device, 2, 2)
    large, out, grads = _on_device(name, fake_device, 4, 8)
    assert small["syncs"] == 0 and large["syncs"] == 0
    assert small["ops"] == large["ops"]
    torch.manual_seed(0)
    module = make_attention(name, 64, 8)
    x = torch.randn(4, 24, 64, requires_grad=True)
    want, want_grads = _eager(name, module, x)
    _close(out, want)  # the device-agnostic paths compute the CPU paths' function
    for a, b in zip(grads, want_grads, strict=True):
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


_LONG = torch.zeros(0, dtype=torch.long)

#: every public op, with options that reach its other paths (streaming, masks, α, modes)
OPS: dict[str, Callable[..., torch.Tensor]] = {
    "dnas": lambda q, k, v: F.doubly_normalized_attention(q, k, v),
    "dnas-streaming": lambda q, k, v: F.doubly_normalized_attention(q, k, v, impl="streaming"),
    "dnas-causal": lambda q, k, v: F.doubly_normalized_attention(q, k, v, is_causal=True),
    "sinkhorn-streaming": lambda q, k, v: F.doubly_normalized_attention(
        q, k, v, iterations=3, impl="streaming"
    ),
    "hnas": lambda q, k, v: F.hybrid_normalized_attention(q, k, v, weight=fd.to_device(torch.tensor(0.3))),
    "hnas-streaming": lambda q, k, v: F.hybrid_normalized_attention(
        q, k, v, weight=fd.to_device(torch.tensor(0.3)), impl="streaming"
    ),
    "generalized-preference": lambda q, k, v: F.generalized_attention(
        q, k, v, preference=fd.to_device(torch.rand(q.shape[-2], k.shape[-2]))
    ),
    "generalized-materialized": lambda q, k, v: F.generalized_attention(
        q, k, v, log_preference=fd.to_device(torch.randn(q.shape[-2], k.shape[-2])), impl="materialized"
    ),
    "generalized-streaming": lambda q, k, v: F.generalized_attention(
        q, k, v, log_preference=fd.to_device(torch.randn(q.shape[-2], k.shape[-2])), impl="streaming"
    ),
    "sparsemax": lambda q, k, v: F.regularized_attention(q, k, v, regularizer=SquaredL2()),
    "sparsemax-streaming": lambda q, k, v: F.regularized_attention(
        q, k, v, regularizer=SquaredL2(), impl="streaming"
    ),
    "entmax13": lambda q, k, v: F.regularized_attention(q, k, v, regularizer=Tsallis(1.3)),
    "entmax15-locality": lambda q, k, v: F.regularized_attention(
        q, k, v, regularizer=Tsallis(1.5), locality=0.1
    ),
    "softmax": lambda q, k, v: F.regularized_attention(q, k, v, regularizer=Shannon()),
    "rbf": lambda q, k, v: F.kernel_attention(q, k, v, kernel=RBF()),
    "rbf-p": lambda q, k, v: F.kernel_attention(q, k, v, kernel=RBF(), magnitude_p=1.5),
    "periodic": lambda q, k, v: F.kernel_attention(q, k, v, kernel=Periodic(6.28)),
    "linear-quadratic": lambda q, k, v: F.kernel_attention(q, k, v, kernel=Linear(), magnitude_p=2.0),
    "linear-linear": lambda q, k, v: F.kernel_attention(
        q, k, v, kernel=Linear(), magnitude_p=2.0, mode="linear"
    ),
    "sparsemax-map": lambda q, k, v: F.sparsemax(q),
    "entmax15-map": lambda q, k, v: F.entmax(q, 1.5),
    "entmax13-map": lambda q, k, v: F.entmax(q, 1.3, max_iter=30),
    "entmax-tensor-alpha": lambda q, k, v: F.entmax(
        q, fd.to_device(torch.full((q.shape[1], 1, 1), 1.4)), max_iter=30
    ),
    "ot": lambda q, k, v: F.ot_attention(q[:, 0], k[:, 0], gamma=1.0),
    "dnas-weights": lambda q, k, v: F.doubly_normalized_weights(q, k),
    "generalized-weights": lambda q, k, v: F.generalized_weights(q, k),
    "kernel-weights": lambda q, k, v: F.kernel_weights(q, k, kernel=RBF()),
    "regularized-weights": lambda q, k, v: F.regularized_attention_weights(q, k, regularizer=Tsallis(1.5)),
    "sparsemax-loss": lambda q, k, v: F.sparsemax_loss(
        q.reshape(-1, q.shape[-1]), fd.to_device(torch.zeros(q.shape[:-1].numel(), dtype=torch.long))
    ),
    "entmax-loss": lambda q, k, v: F.entmax_loss(
        q.reshape(-1, q.shape[-1]), fd.to_device(torch.zeros(q.shape[:-1].numel(), dtype=torch.long))
    ),
}


@pytest.mark.parametrize("name", list(OPS))
def test_fake_device_public_ops_no_sync_constant_ops(name: str, fake_device: torch.device) -> None:  # noqa: ARG001
    counts = []
    for b, h in ((2, 2), (4, 8)):
        g = torch.Generator().manual_seed(0)
        q, k, v = (fd.to_device(torch.randn(b, h, 24, 8, generator=g)).requires_grad_() for _ in range(3))
        torch.manual_seed(0)
        with fd.counting() as c:
            out = OPS[name](q, k, v)
            out.sum().backward()
        assert out.device.type == fd.NAME
        assert torch.isfinite(fd.to_cpu(out)).all()
        counts.append(c)
    assert counts[0]["syncs"] == 0 and counts[1]["syncs"] == 0
    assert counts[0]["ops"] == counts[1]["ops"]


@pytest.mark.parametrize("name", ["dnas", "sparsemax"])
def test_fake_device_query_padding_no_sync(name: str, fake_device: torch.device) -> None:
    """A query-padding mask on a mechanism that normalizes over queries (``dnas``) adds its
    ``-inf`` rows without reading the padding on the host; the output matches the CPU's."""
    torch.manual_seed(0)
    module = make_attention(name, 16, 2)
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    want = module(x, x, x, query_padding_mask=pad)[0]
    module_dev = make_attention(name, 16, 2).to(fake_device)
    module_dev.load_state_dict(module.state_dict())
    with fd.counting() as counts:
        out = module_dev(fd.to_device(x), fd.to_device(x), fd.to_device(x),
                         query_padding_mask=fd.to_device(pad))[0]
    assert counts["syncs"] == 0
    _close(fd.to_cpu(out), want)
