"""Deterministic cost of a forward pass: operation counts and peak tensor memory.

Claims about complexity must not depend on wall-clock time (a loaded machine moves it by
a factor of two). These two measures do not: the same code on the same shapes performs the
same operations and holds the same tensors, whatever else the machine is doing.

* :func:`count_flops` — floating-point operations of the matrix products, from
  :class:`torch.utils.flop_counter.FlopCounterMode` (element-wise work is not counted; the
  products are where the ``T²`` and ``R`` factors of an attention layer live).
* :class:`PeakMemory` — the largest total size of tensor storages alive at once during the
  call, tracked op by op with a dispatch mode (CPU-independent of the allocator's caching).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["PeakMemory", "count_flops", "peak_bytes"]


def count_flops(fn: Callable[[], Any]) -> int:
    """Total FLOPs of the matrix products run by ``fn()`` (no grad)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the context and alive at the same time.

    Every op's output storage is counted once (views share their base's storage) and released
    when the last tensor seen with that storage is garbage-collected. Inputs that existed
    before the context are not counted: the figure is the working memory of the call.

    Attributes:
        peak: the largest live total, in bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors alive]

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[key]
            self.live -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            if key in self._refs:
                self._refs[key][1] += 1
            else:
                self._refs[key] = [storage.nbytes(), 1]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak working memory of ``fn()`` in bytes (no grad), see :class:`PeakMemory`."""
    with torch.no_grad(), PeakMemory() as mem:
        fn()
    return mem.peak
