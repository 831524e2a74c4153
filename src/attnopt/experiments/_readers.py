"""Readers for the paper's image data sets in their standard distribution formats (no download).

* Fashion-MNIST: the four IDX ``.gz`` files (``train-images-idx3-ubyte.gz``, ...);
* CIFAR-10 / CIFAR-100: the "python version" pickles (``cifar-10-batches-py/data_batch_1`` ...,
  ``cifar-100-python/train``, ``test``), read with a restricted unpickler that only builds
  dicts, lists, bytes and numpy arrays (no code from the file is run).

Each reader returns ``(train_images uint8 (N, C, H, W), train_labels int64 (N,), test_images,
test_labels)`` as tensors and raises ``FileNotFoundError``/``ValueError`` naming the file it
expected when a file is missing or malformed.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["read_idx", "read_fashion_mnist", "read_cifar", "FASHION_FILES"]

FASHION_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
#: IDX type byte -> numpy dtype (multi-byte types are big-endian)
_IDX_TYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: expected the file {path}")
    return path


def read_idx(path: str | Path) -> np.ndarray:
    """One IDX file (optionally gzip-compressed) as a numpy array.

    Raises:
        FileNotFoundError: no such file.  ValueError: not a valid IDX file (names the file).
    """
    path = _need(Path(path), "IDX reader")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    need = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != need:
        raise ValueError(f"{path}: IDX body has {len(body)} bytes, the header says {need}")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def read_fashion_mnist(data_dir: str | Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fashion-MNIST from ``data_dir`` (or ``data_dir/fashion-mnist``): images (N, 1, 28, 28) uint8."""
    root = Path(data_dir)
    if not (root / FASHION_FILES[0]).exists() and (root / "fashion-mnist" / FASHION_FILES[0]).exists():
        root = root / "fashion-mnist"
    arrays = [read_idx(_need(root / f, "Fashion-MNIST")) for f in FASHION_FILES]
    xtr, ytr, xte, yte = arrays
    for x, y, f in ((xtr, ytr, FASHION_FILES[0]), (xte, yte, FASHION_FILES[2])):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{root / f}: images (N, H, W) and labels (N,) do not match")
    return (
        torch.from_numpy(xtr.copy()).unsqueeze(1),
        torch.from_numpy(ytr.astype(np.int64)),
        torch.from_numpy(xte.copy()).unsqueeze(1),
        torch.from_numpy(yte.astype(np.int64)),
    )


class _SafeUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("copy_reg", "_reconstructor"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def _load_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    _need(path, "CIFAR")
    try:
        with open(path, "rb") as fh:
            d = _SafeUnpickler(fh, encoding="bytes").load()
        data, labels = np.asarray(d[b"data"], dtype=np.uint8), np.asarray(d[label_key], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{path}: not a CIFAR python batch ({type(exc).__name__}: {exc})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(f"{path}: expected data (N, 3072) and N labels, got {data.shape}, {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar(data_dir: str | Path, which: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 (``which="cifar10"``) or CIFAR-100 (``"cifar100"``, fine labels) python pickles.

    ``data_dir`` is the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``) or
    its parent. Images (N, 3, 32, 32) uint8.
    """
    if which not in ("cifar10", "cifar100"):
        raise ValueError(f"which must be 'cifar10' or 'cifar100', got {which!r}")
    sub = "cifar-10-batches-py" if which == "cifar10" else "cifar-100-python"
    root = Path(data_dir)
    if (root / sub).is_dir():
        root = root / sub
    if which == "cifar10":
        parts = [_load_batch(root / f"data_batch_{i}", b"labels") for i in range(1, 6)]
        test = _load_batch(root / "test_batch", b"labels")
    else:
        parts = [_load_batch(root / "train", b"fine_labels")]
        test = _load_batch(root / "test", b"fine_labels")
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(test[0]), torch.from_numpy(test[1])
