"""The sampled spectral points' base noise (:mod:`attnopt.functional.kernel.gaussian_noise`): standard normal,
reproducible from the generator's state, the C kernel and its PyTorch mirror bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from torch import func

from attnopt import _native
from attnopt.functional.kernel.gaussian_noise import (
    _mirror,
    draw_seed,
    gaussian_noise,
    noise_from_seed,
    seeded_fill,
)
from attnopt.nn import ImplicitKernelAttention

needs_c = pytest.mark.skipif(_native.compiler() is None, reason="needs a C compiler")


@needs_c
@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 8192, 100_001])
def test_the_c_kernel_and_its_pytorch_mirror_give_the_same_bits(n):
    assert seeded_fill(torch.float32) is not None and seeded_fill(torch.float64) is not None
    g = torch.Generator().manual_seed(n)
    for _ in range(3):
        state = g.get_state()
        c = gaussian_noise((n,), g)
        g.set_state(state)
        seed = draw_seed(g)
        assert torch.equal(c, _mirror(seed, (n,)))
        assert torch.equal(noise_from_seed(seed, (n,), torch.float64), c.double())


@needs_c
def test_the_mirror_is_taken_without_the_native_kernels_with_the_same_values(monkeypatch):
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    native = gaussian_noise((2, 3, 5), g)
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    assert seeded_fill(torch.float32) is None
    g.set_state(state)
    assert torch.equal(gaussian_noise((2, 3, 5), g), native)


def test_standard_normal_values():
    x = gaussian_noise((400_000,), torch.Generator().manual_seed(0)).double().numpy()
    assert stats.kstest(x, "norm").pvalue > 1e-3
    # mean 0, variance 1, skewness 0, kurtosis 3 within ~5 standard errors
    se = 1 / np.sqrt(x.size)
    assert abs(x.mean()) < 5 * se and abs(x.var() - 1) < 5 * np.sqrt(2) * se
    assert abs(stats.skew(x)) < 5 * np.sqrt(6) * se and abs(stats.kurtosis(x)) < 5 * np.sqrt(24) * se
    assert np.abs(x).max() < 5.8  # 24-bit uniforms: |x| <= sqrt(-2 log 2^-24) = 5.77


def test_values_are_uncorrelated_within_and_across_draws():
    g = torch.Generator().manual_seed(1)
    a, b = gaussian_noise((200_000,), g).double(), gaussian_noise((200_000,), g).double()
    limit = 5 / np.sqrt(a.numel() / 2)
    half = a.numel() // 2  # a pair's two values sit half the draw apart
    for x, y in [(a[:-1], a[1:]), (a[:half], a[half:]), (a, b)]:
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < limit
    # dependence a correlation misses: the pair's radius and angle are independent
    r2 = a[:half] ** 2 + a[half:] ** 2
    assert stats.kstest(r2.numpy(), "expon", args=(0, 2)).pvalue > 1e-3
    angle = torch.atan2(a[half:], a[:half]).numpy()
    assert stats.kstest(angle, "uniform", args=(-np.pi, 2 * np.pi)).pvalue > 1e-3


def test_the_generator_state_decides_the_draw():
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    first, second = gaussian_noise((64,), g), gaussian_noise((64,), g)
    assert not torch.equal(first, second)
    g.set_state(state)
    assert torch.equal(gaussian_noise((64,), g), first)
    torch.manual_seed(7)  # no generator: torch's default one
    x = gaussian_noise((4, 4), None)
    torch.manual_seed(7)
    assert torch.equal(gaussian_noise((4, 4), None), x) and x.dtype == torch.float32


def test_float64_default_dtype_still_draws_float32():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        x = gaussian_noise((3, 4), torch.Generator().manual_seed(0))
    finally:
        torch.set_default_dtype(old)
    assert x.dtype == torch.float32 and x.shape == (3, 4)


def test_under_vmap_the_seed_follows_randomness():
    g = torch.Generator().manual_seed(2)
    xs = torch.zeros(3, 1)
    state = g.get_state()
    same = func.vmap(lambda x: x + gaussian_noise((4,), g), randomness="same")(xs)
    g.set_state(state)
    plain = gaussian_noise((4,), g)
    assert torch.equal(same, plain.expand(3, 4))
    different = func.vmap(lambda x: x + gaussian_noise((4,), g), randomness="different")(xs)
    assert not torch.equal(different[0], different[1])
    with pytest.raises(RuntimeError, match="randomness"):
        func.vmap(lambda x: x + gaussian_noise((4,), g))(xs)


def test_the_module_draws_from_its_generator_reproducibly():
    m = ImplicitKernelAttention(32, 2, "ikan", num_samples=4, seed=0)
    k = torch.randn(2, 2, 5, 16)
    state = m._generator.get_state()
    a = m._base_noise(k)
    m._generator.set_state(state)
    assert torch.equal(m._base_noise(k), a) and a.shape == (2, 2, 2, 2, 16)
    m._generator.set_state(state)
    b = m._base_noise(k.double())
    assert b.dtype == torch.float64 and torch.equal(b, a.double())
