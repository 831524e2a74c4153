"""OT-ViT task: the bank protocol, the data readers on files in the standard formats, a short fit."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from attnopt.experiments import RunConfig, get_task
from attnopt.experiments._readers import FASHION_FILES, read_cifar, read_fashion_mnist, read_idx
from attnopt.experiments.ot_vit import ClassPool, with_same_class_bank

TASK = get_task("ot-vit")


def test_bank_protocol_same_class_other_image_half_the_time() -> None:
    labels_all = torch.arange(40) % 4
    images = torch.arange(40, dtype=torch.float32).view(40, 1, 1, 1).expand(40, 1, 2, 2).clone()
    pool = ClassPool.build(images, labels_all, 4)
    idx = torch.arange(40)
    g = torch.Generator().manual_seed(0)
    uses = []
    for _ in range(50):
        bank, mask = with_same_class_bank(images[idx], labels_all[idx], idx, pool, g)
        picked = bank[:, 0, 0, 0].long()
        assert torch.equal(labels_all[picked], labels_all[idx])  # same class
        assert not bool((picked == idx).any())  # another image
        uses.append(mask.float().mean())
    assert abs(float(torch.stack(uses).mean()) - 0.5) < 0.05
    cfg = RunConfig(task="ot-vit", arm="ot-vit", seed=0, lr=1e-3, epochs=1, batch_size=8)
    TASK._pool = pool
    out = TASK.train_batch_transform((images[:8], labels_all[:8], idx[:8]), cfg, g)
    assert set(out) == {"images", "labels", "bank_images", "bank_mask"}
    vit = TASK.train_batch_transform(
        (images[:8], labels_all[:8], idx[:8]), cfg.__class__(**{**cfg.__dict__, "arm": "vit"}), g
    )
    assert "bank_images" not in vit


def test_evaluation_uses_the_inputs_own_templates_only() -> None:
    calls = []

    class Spy(torch.nn.Module):
        def forward(self, images, **kw):  # type: ignore[no-untyped-def]
            calls.append(kw)
            return torch.zeros(images.shape[0], 3)

    batch = [(torch.zeros(2, 1, 8, 8), torch.tensor([0, 1]), torch.tensor([0, 1]))]
    TASK.evaluate(Spy(), batch, None, None)  # type: ignore[arg-type]
    assert calls == [{}]


def _idx(path: Path, arr: np.ndarray, code: int = 0x08) -> None:
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(">u1").tobytes()))


def test_fashion_mnist_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    xs = [
        rng.integers(0, 255, (5, 28, 28), dtype=np.uint8),
        rng.integers(0, 255, (3, 28, 28), dtype=np.uint8),
    ]
    ys = [rng.integers(0, 10, 5, dtype=np.uint8), rng.integers(0, 10, 3, dtype=np.uint8)]
    for f, a in zip(FASHION_FILES, [xs[0], ys[0], xs[1], ys[1]], strict=True):
        _idx(tmp_path / f, a)
    xtr, ytr, xte, yte = read_fashion_mnist(tmp_path)
    assert xtr.shape == (5, 1, 28, 28) and torch.equal(xtr[:, 0], torch.from_numpy(xs[0]))
    assert torch.equal(yte, torch.from_numpy(ys[1].astype(np.int64)))
    (tmp_path / FASHION_FILES[3]).write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x09abc"))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz"):
        read_fashion_mnist(tmp_path)
    (tmp_path / FASHION_FILES[2]).unlink()
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.gz"):
        read_fashion_mnist(tmp_path)
    with pytest.raises(ValueError, match="magic"):
        (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
        read_idx(tmp_path / "bad")


def _cifar_batch(path: Path, n: int, key: bytes, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data, labels = rng.integers(0, 255, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()
    with open(path, "wb") as fh:
        pickle.dump(
            {b"batch_label": b"x", key: labels, b"data": data, b"filenames": [b"f"] * n}, fh, protocol=2
        )
    return data, labels


def test_cifar_readers(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    parts = [_cifar_batch(root / f"data_batch_{i}", 2, b"labels", i) for i in range(1, 6)]
    test = _cifar_batch(root / "test_batch", 3, b"labels", 9)
    xtr, ytr, xte, yte = read_cifar(tmp_path, "cifar10")
    assert xtr.shape == (10, 3, 32, 32) and yte.tolist() == test[1]
    assert torch.equal(xtr[2].flatten(), torch.from_numpy(parts[1][0][0]))  # channel-major rows
    c100 = tmp_path / "c100"
    c100.mkdir()
    _cifar_batch(c100 / "train", 4, b"fine_labels", 1)
    _cifar_batch(c100 / "test", 2, b"fine_labels", 2)
    assert read_cifar(c100, "cifar100")[0].shape == (4, 3, 32, 32)
    (root / "test_batch").write_bytes(pickle.dumps({b"data": 1}))
    with pytest.raises(ValueError, match="test_batch"):
        read_cifar(root, "cifar10")

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("pwned",))

    (root / "test_batch").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(ValueError, match="not allowed"):
        read_cifar(root, "cifar10")
    (root / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        read_cifar(root, "cifar10")


def test_data_dir_required_for_paper_data() -> None:
    cfg = RunConfig(task="ot-vit", arm="vit", seed=0, lr=1e-3, epochs=1, batch_size=8, dataset="cifar10")
    with pytest.raises(ValueError, match="--data-dir"):
        TASK.build_data(cfg)
