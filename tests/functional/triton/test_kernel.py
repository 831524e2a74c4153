"""Implicit-kernel attention on the Triton flash primitive against the float64 reference.

Values and gradients (q, k, v and the spectral points, which IKAN learns) under
``attnopt.backend("triton")``; without CUDA in Triton's interpreter (``_helpers``).
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.kernels import RBF, Linear, NonStationaryFourier, RandomFourier
from tests.functional.triton._helpers import DEVICE, assert_close, blocks, grads, rand

B, H, NQ, NK, D, DV, R = 1, 2, 21, 27, 8, 6, 12


def _kernel(name: str):
    if name == "ika":  # stationary random Fourier, per-head points that require grad (learned)
        w = rand(H, R, D, seed=20)
        return RandomFourier(w), [w]
    if name == "nonstationary":
        w1, w2 = rand(R, D, seed=21), rand(R, D, seed=22)
        return NonStationaryFourier(w1, w2), [w1, w2]
    if name == "linear":  # a feature kernel without the Fourier form: the flash primitive's score mode 1
        return Linear(), []
    return RBF(), []


@pytest.mark.parametrize(("name", "p", "kind"), [
    ("ika", 1.0, "none"), ("ika", 2.0, "causal_padding"), ("nonstationary", 0.5, "none"),
    ("rbf", 2.0, "full"), ("linear", 2.0, "none"),
])
def test_kernel_attention_matches_float64_reference(name, p, kind):
    q, k, v = rand(B, H, NQ, D, seed=1), rand(B, H, NK, D, seed=2), rand(B, H, NK, DV, seed=3)
    kernel, params = _kernel(name)
    mask, causal = None, False
    if kind == "causal_padding":
        mask = torch.ones(NK, dtype=torch.bool, device=DEVICE)
        mask[[1, 11]] = False
        causal = True
    elif kind == "full":  # with a fully masked row (query 2)
        mask = torch.rand(NQ, NK, generator=torch.Generator().manual_seed(4)).to(DEVICE) > 0.3
        mask[2] = False
    kw = dict(kernel=kernel, magnitude_p=p, attn_mask=mask, is_causal=causal)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, **kw)
    assert dispatch.last_dispatch["kernel"] == "triton"
    ref = kernel_weights(q, k, **kw) @ v
    assert_close(out, ref, 1e-12, what="out")
    inputs = (q, k, v, *params)
    for i, (got, want) in enumerate(zip(grads(out, inputs), grads(ref, inputs))):
        assert_close(got, want, 1e-10, rtol=1e-10, what=f"grad {i}")
