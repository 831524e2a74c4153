"""Helpers of the Triton kernel tests.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
by ``tests/conftest.py`` before the kernels load); with CUDA the same tests run on the GPU.
``@pytest.mark.gpu`` tests need real CUDA and stay outside the default run (``pytest -m gpu``).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

#: the device the kernels run on here: CUDA when present, else the CPU interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def blocks(bm: int = 16, bn: int = 16):
    """Small kernel blocks, so that small test sizes span several (and partial) blocks."""
    from attnopt.functional.triton import _flash

    _flash.BLOCKS[0] = (bm, bn)
    try:
        yield
    finally:
        _flash.BLOCKS[0] = None


def rand(*shape: int, dtype=torch.float64, seed: int = 0, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=DEVICE)
    return x.requires_grad_(grad)


def grads(out: torch.Tensor, inputs, seed: int = 1):
    """Gradients of ``<out, r>`` for a fixed random ``r`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    return torch.autograd.grad((out.double() * r).sum(), inputs)


def assert_close(got, want, atol: float, rtol: float = 0.0, what: str = "") -> None:
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")
