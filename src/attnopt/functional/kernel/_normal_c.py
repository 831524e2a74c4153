r"""The seeded Gaussian fill of ``_native/normal.c`` (``normal_fill_at_*``): its lookup per dtype, shared by
the noise leaf (:mod:`.gaussian_noise`) and the sampled node (:mod:`.sampled_fourier`, which fills
its scratch from a seed). A helper, not an implementation.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from attnopt import _native

__all__ = ["seeded_fill"]


def seeded_fill(dtype: torch.dtype) -> Any:
    """``normal_fill_at_{f32,f64}(seed address, out address, n)`` of ``_native/normal.c``, or None
    (no compiler, ``ATTNOPT_NATIVE=0``, a dtype other than float32 / float64)."""
    lib = _native.library("normal")
    if lib is None or dtype not in _SUFFIX:
        return None
    fn = getattr(lib, f"normal_fill_at_{_SUFFIX[dtype]}")
    if fn.restype is not None:  # argument types declared once per library object (ctypes' default: c_int)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
    return fn


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
