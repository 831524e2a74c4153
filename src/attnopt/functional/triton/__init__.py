r"""GPU kernels in Triton (and FlexAttention) for the attnopt mechanisms: the ``"triton"`` backend.

One file per family, each importing Triton only when it is first used (Triton is an optional
dependency, the ``gpu`` extra; CUDA wheels of torch bring it):

* :mod:`._flash` — the one flash-style primitive every normalization pass is built from:
  ``t_ij = scale <a_i, b_j> + cb_j + m_ij``, row log-sum-exp and (optionally) the softmax
  average of values, with a Triton backward; a ``torch.library.triton_op``.
* :mod:`._tiles` — the ``@triton.jit`` tile helpers the flash-style kernels share (program ids,
  strided tile loads and stores, causal loop bounds, the online-softmax step and finish).
* :mod:`.doubly_normalized` — DNAS, Sinkhorn-K and HNAS as chains of that primitive.
* :mod:`.sparse` — sparsemax / α-entmax attention (per-row threshold over key blocks).
* :mod:`.flex_generalized` — generalized attention with a preference through FlexAttention.
* :mod:`.kernel` — implicit-kernel attention (random Fourier features, L^p magnitude).

Routing. Each public op asks :func:`wanted` early: the Triton path runs when
``attnopt.backend("triton")`` forces it (on any device: on CPU tensors through Triton's
interpreter, ``TRITON_INTERPRET=1`` set before the kernels load — that is how CI tests them), or
under ``"auto"`` for a CUDA tensor when Triton is importable; it then records ``"triton"`` in
``dispatch.last_dispatch``.
"""
from __future__ import annotations

import importlib.util
import os

from torch import Tensor

from attnopt.functional import dispatch

__all__ = ["available", "wanted", "interpreting", "check_device"]

_AVAILABLE: list[bool] = []


def available() -> bool:
    """Whether the ``triton`` package is importable (checked once, without importing it)."""
    if not _AVAILABLE:
        _AVAILABLE.append(importlib.util.find_spec("triton") is not None)
    return _AVAILABLE[0]


def interpreting() -> bool:
    """Whether Triton kernels decorated now run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def wanted(x: Tensor) -> bool:
    """Whether a public op should run its Triton kernel on ``x`` (see the module docstring)."""
    name = dispatch.current_backend()
    if name == "triton":
        return True
    return name == "auto" and isinstance(x, Tensor) and x.is_cuda and available()


def check_device(x: Tensor, interpreted: bool) -> None:
    """Raise a clear error when a kernel cannot run on ``x``'s device.

    Args:
        x: an input tensor.
        interpreted: whether the family's kernels were decorated under the interpreter.
    Raises:
        RuntimeError: Triton missing, or CPU tensors with compiled kernels (or CUDA tensors
            with interpreted ones).
    """
    if not available():
        raise RuntimeError("attnopt.backend('triton') needs the triton package (pip install 'attnopt[gpu]')")
    if x.is_cuda and interpreted:
        raise RuntimeError("attnopt's Triton kernels were loaded under TRITON_INTERPRET=1: they run on CPU "
                           "tensors only; unset it in a process that uses CUDA tensors")
    if not x.is_cuda and not interpreted:
        raise RuntimeError(
            f"attnopt.backend('triton') on a {x.device.type} tensor runs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before attnopt's Triton kernels are first used"
        )
