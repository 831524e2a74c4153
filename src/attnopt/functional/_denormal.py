r"""Flush subnormal floats to zero around a kernel call (internal).

Under a position bias such as ALiBi (``log u_ij = −m_h |i − j|``) most far keys get softmax
weights below float32's smallest normal number (``exp(−88) ≈ 1.2e-38``): the arithmetic on
those *subnormal* numbers is ~100× slower on x86, and made PyTorch's fused CPU attention
backward 2.5× slower with an ALiBi mask than without (B·H = 8, N = 512, d = 64). Flushing
them to zero (the CPU's FTZ/DAZ modes, :func:`torch.set_flush_denormal`) changes no sum at
float precision — a weight below 1.2e-38 next to a row maximum of weight ≥ 1/Nk — and
removes that cost. (Inside the block subnormal *inputs* also read as zero: entries of
``q``, ``k``, ``v`` or of a gradient below 1.2e-38 in float32, 2.2e-308 in float64.)

:func:`flush_denormal` turns the mode on for the calling thread only for the duration of
the block and restores the previous mode (PyTorch has no getter: the mode is read by
converting a subnormal constant). With several intra-op threads, the worker threads keep
their own mode.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["flush_denormal", "flush_denormal_on"]


def flush_denormal_on() -> bool:
    """Whether this thread flushes subnormal floats to zero now."""
    return torch.tensor(1e-40, dtype=torch.float32).item() == 0.0


@contextmanager
def flush_denormal() -> Iterator[None]:
    """Flush subnormals to zero inside the block (this thread); the previous mode is restored."""
    if flush_denormal_on():
        yield
        return
    switched = torch.set_flush_denormal(True)  # False (and no change) where unsupported
    try:
        yield
    finally:
        if switched:
            torch.set_flush_denormal(False)
