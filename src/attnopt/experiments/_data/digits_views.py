"""Three "detectors" of scikit-learn's 8×8 digits: region features for multi-view fusion.

doubly-normalized-attention Sec. 7.1 fuses the bounding-box features of three object
detectors (different backbones) with one attention layer. The offline stand-in: three
region-feature extractors of the same digit, differing in receptive field and preprocessing,
so that their views are partly redundant and partly complementary:

=========  =======  ======================================================================
view       regions  feature of one region
=========  =======  ======================================================================
patch      16       primary. Raw pixels of a non-overlapping 2×2 patch (4) + its centre (2)
blur       9        4×4 windows at stride 2 of the Gaussian-blurred image (σ = 1) (16) +
                    centre (2): larger receptive field, smoothed
edges      16       8 row strips and 8 column strips of the Sobel gradient magnitude (8) +
                    [is-row, position] (2): whole-width receptive field, edge preprocessing
=========  =======  ======================================================================

Like a detector that misses objects, each view sees its own copy of the digit with one
random 3×3 block blanked (independent per view and image, fixed by ``seed``), so no single
view has the whole digit while the three together almost always do. Pixels are scaled to
[0, 1] and coordinates to [-1, 1].
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["VIEW_NAMES", "digits_views"]

VIEW_NAMES: tuple[str, ...] = ("patch", "blur", "edges")


def _occlude(images: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    out = images.copy()
    n, h, w = images.shape
    rows = rng.integers(0, h - size + 1, n)
    cols = rng.integers(0, w - size + 1, n)
    for i in range(n):
        out[i, rows[i]:rows[i] + size, cols[i]:cols[i] + size] = 0.0
    return out


def _centre(r: float, c: float, h: int) -> list[float]:
    return [2 * r / (h - 1) - 1, 2 * c / (h - 1) - 1]


def _patch_view(img: np.ndarray) -> np.ndarray:
    n = img.shape[0]
    feats = []
    for r in range(0, 8, 2):
        for c in range(0, 8, 2):
            pix = img[:, r:r + 2, c:c + 2].reshape(n, 4)
            feats.append(np.concatenate([pix, np.tile(_centre(r + 0.5, c + 0.5, 8), (n, 1))], 1))
    return np.stack(feats, 1)


def _blur_view(img: np.ndarray) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    n = img.shape[0]
    blurred = gaussian_filter(img, sigma=(0, 1.0, 1.0), mode="constant")
    feats = []
    for r in range(0, 5, 2):
        for c in range(0, 5, 2):
            pix = blurred[:, r:r + 4, c:c + 4].reshape(n, 16)
            feats.append(np.concatenate([pix, np.tile(_centre(r + 1.5, c + 1.5, 8), (n, 1))], 1))
    return np.stack(feats, 1)


def _edges_view(img: np.ndarray) -> np.ndarray:
    from scipy.ndimage import sobel

    n = img.shape[0]
    mag = np.hypot(sobel(img, axis=1, mode="constant"), sobel(img, axis=2, mode="constant")) / 4.0
    feats = []
    for i in range(8):
        pos = 2 * i / 7 - 1
        feats.append(np.concatenate([mag[:, i, :], np.tile([1.0, pos], (n, 1))], 1))
        feats.append(np.concatenate([mag[:, :, i], np.tile([-1.0, pos], (n, 1))], 1))
    return np.stack(feats, 1)


def digits_views(*, seed: int = 0, occlusion: int = 3) -> dict[str, Tensor]:
    """The three views of every digit of ``sklearn.datasets.load_digits``.

    Args:
        seed: seed of the per-view occlusions.
        occlusion: side of the blanked square (0 = none).
    Returns:
        ``{"patch": (1797, 16, 6), "blur": (1797, 9, 18), "edges": (1797, 16, 10), "label": (1797,)}``,
        float32 features and int64 labels.
    Raises:
        ValueError: ``occlusion`` not in 0..8.
    """
    if not 0 <= occlusion <= 8:
        raise ValueError(f"occlusion must be in 0..8, got {occlusion}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float64) / 16.0
    rng = np.random.default_rng(seed)
    out: dict[str, Tensor] = {}
    for name, extract in zip(VIEW_NAMES, (_patch_view, _blur_view, _edges_view)):
        seen = _occlude(images, rng, occlusion) if occlusion else images
        out[name] = torch.from_numpy(extract(seen)).float()
    out["label"] = torch.from_numpy(digits.target.astype(np.int64))
    return out
