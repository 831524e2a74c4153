"""The backend switch: ``attnopt.backend("reference" | "cpu")`` and ``dispatch.last_dispatch``.

Every family's router honours the forced backend: ``"reference"`` runs the plain-PyTorch
reference (no C kernel runs: ``_native.library`` answers ``None`` inside the block), ``"cpu"``
the CPU kernels / fast paths (and refuses tensors off the CPU). Both agree with ``"auto"`` and
with the float64 oracles, values and gradients.
"""

from __future__ import annotations

import pytest
import torch

import attnopt
import attnopt.functional as F
from attnopt import _native
from attnopt.functional import dispatch
from attnopt.functional.regularized.regularizers import Shannon, SquaredL2, Tsallis
from attnopt.kernels import RBF, Linear, Periodic
from attnopt.nn.registry import make_attention

_LP = torch.randn(16, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

#: (mechanism recorded in last_dispatch, call)
CASES = {
    "dnas": ("doubly_normalized", lambda q, k, v: F.doubly_normalized_attention(q, k, v)),
    "dnas-causal": (
        "doubly_normalized",
        lambda q, k, v: F.doubly_normalized_attention(q, k, v, is_causal=True),
    ),
    "lnas": ("lnas", lambda q, k, v: F.doubly_normalized_attention(q, k, v, iterations=0)),
    "sinkhorn": ("sinkhorn", lambda q, k, v: F.doubly_normalized_attention(q, k, v, iterations=3)),
    "hnas": (
        "hybrid_normalized",
        lambda q, k, v: F.hybrid_normalized_attention(q, k, v, weight=torch.tensor(0.3, dtype=q.dtype)),
    ),
    "generalized": (
        "generalized",
        lambda q, k, v: F.generalized_attention(q, k, v, log_preference=_LP.to(q.dtype)),
    ),
    "generalized-causal": ("generalized", lambda q, k, v: F.generalized_attention(q, k, v, is_causal=True)),
    "sparsemax": ("sparse", lambda q, k, v: F.regularized_attention(q, k, v, regularizer=SquaredL2())),
    "entmax15": ("sparse", lambda q, k, v: F.regularized_attention(q, k, v, regularizer=Tsallis(1.5))),
    "entmax13": ("sparse", lambda q, k, v: F.regularized_attention(q, k, v, regularizer=Tsallis(1.3))),
    "softmax": ("regularized", lambda q, k, v: F.regularized_attention(q, k, v, regularizer=Shannon())),
    "rbf": ("kernel", lambda q, k, v: F.kernel_attention(q, k, v, kernel=RBF())),
    "periodic": (
        "kernel",
        lambda q, k, v: F.kernel_attention(q, k, v, kernel=Periodic(6.0), magnitude_p=2.0),
    ),
    "linear": (
        "kernel",
        lambda q, k, v: F.kernel_attention(q, k, v, kernel=Linear(), magnitude_p=2.0, mode="linear"),
    ),
    "ot": ("ot", lambda q, k, v: F.ot_attention(q[:, 0], k[:, 0], gamma=1.0)),
}


def _qkv(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 16, 8, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _run(call, q, k, v):
    out = call(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v), allow_unused=True)
    return out.detach(), [None if g is None else g.detach() for g in grads]


@pytest.mark.parametrize("name", list(CASES))
def test_reference_and_cpu_match_auto_and_record(name: str) -> None:
    mech, call = CASES[name]
    q, k, v = _qkv()
    out, grads = _run(call, q, k, v)
    for backend in ("reference", "cpu"):
        with attnopt.backend(backend):
            assert dispatch.current_backend() == backend
            got, got_grads = _run(call, q, k, v)
        assert dispatch.last_dispatch[mech] == backend
        torch.testing.assert_close(got, out, atol=2e-5, rtol=2e-5)
        for a, b in zip(got_grads, grads, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
    assert dispatch.current_backend() == "auto"


@pytest.mark.parametrize(
    "name", ["dnas", "sinkhorn", "hnas", "generalized", "sparsemax", "entmax15", "periodic"]
)
def test_reference_is_float64_exact(name: str) -> None:
    """The reference in float64 against auto in float64: the same function to rounding."""
    _, call = CASES[name]
    q, k, v = _qkv(torch.float64)
    out, grads = _run(call, q, k, v)
    with attnopt.backend("reference"):
        got, got_grads = _run(call, q, k, v)
    torch.testing.assert_close(got, out, atol=1e-10, rtol=1e-10)
    for a, b in zip(got_grads, grads, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_reference_runs_no_c_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``backend("reference")`` no C library is loaded or called, whatever the op."""
    calls: list[str] = []
    real = _native.library

    def spy(name: str):
        lib = real(name)
        if lib is not None:
            calls.append(name)
        return lib

    monkeypatch.setattr(_native, "library", spy)
    q, k, v = _qkv()
    with attnopt.backend("reference"):
        assert _native.switched_off()
        for _, call in CASES.values():
            _run(call, q, k, v)
        for name in ("dnas", "t5", "alibi", "sparsemax", "entmax", "ikan", "expsin"):
            module = make_attention(name, 16, 2)
            module(torch.randn(2, 16, 16))[0].sum().backward()
    assert calls == []


def test_cpu_backend_refuses_other_devices() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, device="meta") for _ in range(3))
    with attnopt.backend("cpu"), pytest.raises(ValueError, match="backend\\('cpu'\\)"):
        F.doubly_normalized_attention(q, k, v)


def test_backend_rejects_unknown_name_and_restores() -> None:
    with pytest.raises(ValueError, match="backend name"):
        with attnopt.backend("cuda"):
            pass
    with pytest.raises(RuntimeError), attnopt.backend("reference"):
        raise RuntimeError
    assert dispatch.current_backend() == "auto"
