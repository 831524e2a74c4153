"""Atomic, checksummed cache of a built data set under the run's output directory.

:func:`cached` returns ``build()``'s result, stored with ``torch.save`` at ``path`` next to
``path.sha256``; a file that is missing, does not load or whose SHA-256 does not match is
rebuilt (a killed write or a corrupted file never poisons later runs).
"""
from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["cached"]

T = TypeVar("T")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


#: (path, the file's sha256) -> the object loaded from it, for the last few files: a run set
#: calls ``build_data`` once per run, and unpickling a corpus of token lists with
#: ``weights_only=True`` took seconds each time
_LOADED: dict[tuple[str, str], Any] = {}
_KEEP_LOADED = 4


def cached(path: str | os.PathLike[str] | None, build: Callable[[], T]) -> T:
    """``build()``, cached at ``path`` (``None``: no cache). The object must be ``torch.save``-able
    with plain containers, tensors, numbers and strings (it is reloaded with ``weights_only=True``).

    A file already loaded or written in this process (same path, same content) returns the same
    object again, without unpickling: callers must not modify it in place."""
    if path is None:
        return build()
    path = Path(path)
    digest_path = path.with_name(path.name + ".sha256")
    try:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest == digest_path.read_text().strip():
            key = (str(path.resolve()), digest)
            if key not in _LOADED:
                _remember(key, torch.load(io.BytesIO(data), weights_only=True))
            obj: Any = _LOADED[key]
            return obj
    except (OSError, RuntimeError, ValueError, EOFError):
        pass
    obj = build()
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    _atomic_write(path, data)
    digest = hashlib.sha256(data).hexdigest()
    _atomic_write(digest_path, (digest + "\n").encode())
    _remember((str(path.resolve()), digest), obj)
    return obj


def _remember(key: tuple[str, str], obj: Any) -> None:
    while len(_LOADED) >= _KEEP_LOADED:
        _LOADED.pop(next(iter(_LOADED)))
    _LOADED[key] = obj
