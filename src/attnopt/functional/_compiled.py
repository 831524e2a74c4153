r"""Opt-in :func:`torch.compile` that falls back to eager where it cannot run.

``attnopt.functional.compiled(obj)`` (also ``attnopt.compiled``) is
``torch.compile(obj, **options)`` when the inductor backend can build code for the device,
and ``obj`` itself (eager, unchanged) otherwise — no error, no warning. Inductor on CPU
needs a C++ compiler (``torch._inductor.config.cpp.cxx``, by default ``$CXX`` or ``g++``);
on CUDA it needs Triton. Other backends (``"eager"``, ``"aot_eager"``) need neither and are
always compiled.

Usage, as ``torch.compile``::

    layer = attnopt.functional.compiled(attnopt.nn.make_attention("hnas", 512, 8))
    fast = attnopt.functional.compiled(attnopt.hybrid_normalized_attention, dynamic=False)

Measured (``attnopt bench --only compiled``, B·H = 8, N = 256, d = 64, fwd+bwd, float32,
one CPU thread, thread CPU time, a loaded 2-core machine): compiling did *not* win — HNAS
1.00× eager, sparsemax attention 1.05×, generalized T5 1.34× — after 9–22 s of compiling
per function (28–83 s in an earlier run): the ops already run one fused node (or a fused
ATen kernel) per step, and their input checks force graph breaks. So nothing in attnopt
compiles by default; the helper is for users whose surrounding model gains from it.
"""
from __future__ import annotations

import itertools
import shutil
from typing import Any, TypeVar

import torch

__all__ = ["compiled", "inductor_available", "cpu_compiler"]

T = TypeVar("T")


def cpu_compiler() -> str | None:
    """Path of the C++ compiler CPU inductor would use, or ``None`` if none is installed."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - a torch build without inductor
        return None
    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    for name in names:
        if name:
            path = shutil.which(name)
            if path is not None:
                return path
    return None


def inductor_available(device: str | torch.device = "cpu") -> bool:
    """Whether ``torch.compile``'s default (inductor) backend can build code for ``device``."""
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_compiler() is not None
    if kind == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover
            return False
        return bool(has_triton())
    return False


def _device_of(obj: object) -> torch.device:
    if isinstance(obj, torch.nn.Module):
        first = next(itertools.chain(obj.parameters(), obj.buffers()), None)
        if first is not None:
            return first.device
    return torch.device("cpu")


def compiled(obj: T, *, device: str | torch.device | None = None, backend: str = "inductor",
             **options: Any) -> T:
    """``torch.compile(obj, backend=backend, **options)``, or ``obj`` unchanged where that cannot run.

    Args:
        obj: a function or an ``nn.Module``.
        device: where it will run (default: a module's parameters' device, else CPU).
        backend: as ``torch.compile``; only ``"inductor"`` needs a C++ compiler / Triton.
        options: passed to :func:`torch.compile` (``mode``, ``dynamic``, ``fullgraph``, …).
    Returns:
        The compiled object, or ``obj`` itself (eager) when the inductor backend has no
        compiler for ``device`` — silently: eager computes the same function.
    """
    if backend == "inductor" and not inductor_available(_device_of(obj) if device is None else device):
        return obj
    out: T = torch.compile(obj, backend=backend, **options)  # type: ignore[call-overload]
    return out
