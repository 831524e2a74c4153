"""A fake accelerator for tests: CPU memory labelled as another device (PyTorch's PrivateUse1 Python backend).

A tensor on it is a wrapper without storage (``data_ptr()`` raises, ``is_cpu`` is ``False``)
around a CPU tensor; every aten op on it runs by one Python fallback on the unwrapped CPU
tensors and wraps the results back. So attnopt sees "a device that is not the CPU": it must
take its device-agnostic paths, a C kernel handed such a tensor fails at once (no memory), and
the fallback counts the host syncs (``aten._local_scalar_dense``, ``is_nonzero``, ``equal``) and
the ops of every call.

Set up once per process (:func:`device`), before the process runs its first backward (the
autograd engine sizes its per-device queues then); the backend is renamed ``fakedev``
(a rename is once per process: a process that renames PrivateUse1 otherwise cannot use this).
"""
from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["device", "to_device", "to_cpu", "counting", "direct_checkpoint", "SYNC_OPS"]

#: aten ops that read a device value on the host
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item"})
_STATE: dict[str, Any] = {"lib": None}
#: the PrivateUse1 backend's name in this process (``torch.device("fakedev")``)
NAME = "fakedev"
_COUNTS: list[collections.Counter] = []


class FakeDeviceTensor(torch.Tensor):
    """CPU values (``elem``) labelled as a ``privateuseone`` tensor."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeDeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=torch.device(NAME, 0),
            requires_grad=False,
        )
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _fallback(func, *args, **(kwargs or {}))

    def data_ptr(self) -> int:  # what a ctypes call reads: a device tensor must never reach one
        raise AssertionError("a host (C) kernel was handed a device tensor")

    def __repr__(self) -> str:  # (the default repr reads values through ops we do not count)
        return f"FakeDeviceTensor({self.elem!r})"


def _unwrap(x: Any) -> Any:
    if isinstance(x, FakeDeviceTensor):
        return x.elem
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    name = op._schema.name
    for c in _COUNTS:
        c["ops"] += 1
        if name in SYNC_OPS:
            c["syncs"] += 1
    cargs, ckwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
    out = op(*cargs, **ckwargs)
    if name in SYNC_OPS:
        return out
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cpu":  # .to("cpu"), .cpu(): a real CPU tensor
        return out
    inputs = {id(x.elem): x for x in (*args, *kwargs.values()) if isinstance(x, FakeDeviceTensor)}
    for v in kwargs.values():
        if isinstance(v, (list, tuple)):
            inputs.update({id(x.elem): x for x in v if isinstance(x, FakeDeviceTensor)})

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor):
            if id(x) in inputs:  # in place / out=: the same wrapper
                return inputs[id(x)]
            return FakeDeviceTensor(x)
        return x

    return tree_map(wrap, out)


def device() -> torch.device:
    """The fake device (set up on the first call)."""
    if _STATE["lib"] is None:
        from torch.utils.backend_registration import (
            _DummyBackendModule,
            _setup_privateuseone_for_python_backend,
        )

        class _Module(_DummyBackendModule):  # type: ignore[misc]
            # torch.utils.checkpoint asks every registered device for its autocast dtypes: without
            # this the process's later checkpointed backward calls (any device) raise
            def get_amp_supported_dtype(self) -> list[torch.dtype]:
                return []

            # ... and AOT autograd (opcheck, torch.compile) saves / restores every device's RNG
            def get_rng_state(self, device: object = None) -> torch.Tensor:  # noqa: ARG002
                return torch.empty(0, dtype=torch.uint8)

            def set_rng_state(self, state: torch.Tensor, device: object = None) -> None:  # noqa: ARG002
                return None

        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(_fallback, "PrivateUse1")
        _STATE["lib"] = lib
    return torch.device(NAME, 0)


def to_device(x: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``x`` on the fake device (``requires_grad`` kept)."""
    device()
    out = FakeDeviceTensor(x.detach().clone())
    return out.requires_grad_(x.requires_grad)


def to_cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU values of a fake-device tensor (detached)."""
    return x.elem.detach().clone() if isinstance(x, FakeDeviceTensor) else x.detach()


@contextmanager
def counting() -> Iterator[collections.Counter]:
    """Count the aten ops (``"ops"``) and host syncs (``"syncs"``) run on the fake device in the block."""
    c: collections.Counter = collections.Counter()
    _COUNTS.append(c)
    try:
        yield c
    finally:
        _COUNTS.remove(c)


def _direct(fn: Any, *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:  # noqa: ARG001
    return fn(*args, **kwargs)


@contextmanager
def direct_checkpoint() -> Iterator[None]:
    """Run attnopt's activation checkpoints as plain calls inside the block.

    ``torch.utils.checkpoint``'s backward aborts the process on a Python-defined PrivateUse1
    device (its device guard has no stream / event support), so the streaming passes of
    :mod:`attnopt.functional.doubly_normalized.streaming` store their blocks here instead of recomputing
    them: the same ops and values, more memory.
    """
    from attnopt.functional.doubly_normalized import streaming as _sinkhorn_chunked

    saved = _sinkhorn_chunked.checkpoint
    _sinkhorn_chunked.checkpoint = _direct  # type: ignore[assignment]
    try:
        yield
    finally:
        _sinkhorn_chunked.checkpoint = saved
