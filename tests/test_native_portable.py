"""The C kernels built for a CPU without AVX (``-march=x86-64-v2``) give the results of the
``-march=native`` build: the branches a machine without AVX-512 / AVX2 compiles (scalar and
SSE fallbacks of the intrinsics paths) are exercised here, where ``-march=native`` never takes
them. Values and gradients, float32 and float64, through the public ops that reach each C file."""
from __future__ import annotations

import platform

import pytest
import torch

from attnopt import _native
from attnopt.functional import (
    doubly_normalized_attention,
    generalized_attention,
    kernel_attention,
    regularized_attention,
)
from attnopt.functional.kernel.gaussian_noise import noise_from_seed
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from attnopt.kernels import NonStationaryFourier, Periodic, RandomFourier
from attnopt.nn import ImplicitKernelAttention, T5RelativePreference

pytestmark = pytest.mark.skipif(
    _native.compiler() is None or platform.machine() not in ("x86_64", "AMD64")
    or _native.blas() is None,
    reason="needs a C compiler, x86-64 and the BLAS the whole-call paths use",
)


@pytest.fixture(scope="module")
def portable_cache(tmp_path_factory):
    """One cache folder for the portable builds of both dtypes (each file is compiled once)."""
    return tmp_path_factory.mktemp("portable-native")


def _cases(dtype: torch.dtype) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    d, r = 16, 8
    nsf = NonStationaryFourier.gaussian(r, d, 0.3, 0.2, generator=g, dtype=dtype)
    rff = RandomFourier(torch.randn(r, d, generator=g, dtype=dtype) * 0.3)
    torch.manual_seed(0)
    t5 = T5RelativePreference(4).to(dtype)
    ika = ImplicitKernelAttention(4 * d, 4, "mikan", num_samples=r, p=1.5, seed=0, hidden=8).to(dtype)

    def sampled(q, k, v):
        ika._generator.manual_seed(1)  # the same noise in both builds
        out, _ = ika.attend(q, k, v, None, False, False)
        return out + ika.kl()

    return {
        "ikan p=1.5": lambda q, k, v: kernel_attention(q, k, v, kernel=nsf, magnitude_p=1.5),
        "ika-ns p=2": lambda q, k, v: kernel_attention(q, k, v, kernel=nsf, magnitude_p=2.0),
        "ika-s p=1": lambda q, k, v: kernel_attention(q, k, v, kernel=rff, magnitude_p=1.0),
        "sampled mikan": sampled,
        "expsin": lambda q, k, v: kernel_attention(q, k, v, kernel=Periodic(6.0)),
        "t5": lambda q, k, v: generalized_attention(q, k, v, log_preference=t5(q.shape[-2], k.shape[-2])),
        "dnas": lambda q, k, v: doubly_normalized_attention(q, k, v),
        "sparsemax": lambda q, k, v: regularized_attention(q, k, v, regularizer=SquaredL2()),
        "entmax-1.5": lambda q, k, v: regularized_attention(q, k, v, regularizer=Tsallis(1.5)),
    }


def _results(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # the sampled points' base noise (normal.c): the same bits in every build (no fused multiply-add)
    out = {"noise": [noise_from_seed(torch.tensor(12345), (3, 1001), dtype)]}
    for name, fn in _cases(dtype).items():
        q, k, v = (torch.randn(2, 4, 37, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
        o = fn(q, k, v)
        go = torch.randn(o.shape, generator=g, dtype=dtype)
        out[name] = [o.detach(), *torch.autograd.grad(o, (q, k, v), go)]
    return out


@pytest.mark.slow  # builds a second (portable) copy of the libraries: ~13 s; `pytest -m slow`
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_build_without_avx_gives_the_native_results(dtype, monkeypatch, portable_cache):
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
    native = _results(dtype)
    flags = tuple("-march=x86-64-v2" if f == "-march=native" else f for f in _native.FLAGS)
    monkeypatch.setattr(_native, "FLAGS", flags)
    monkeypatch.setattr(_native, "_LIBS", {})
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(portable_cache))
    portable = _results(dtype)
    built = {p.name.split("-")[0] for p in portable_cache.glob("*.so")}
    assert {"fourier_features", "spectral_sample", "periodic", "biased_softmax", "normal"} <= built, built
    assert torch.equal(portable["noise"][0], native["noise"][0])
    # relative to each tensor's largest entry: the summation order differs with the vector width,
    # and L^1 key weights exp(s‖k‖₁²/2 − max) amplify a rounding of ‖k‖₁ (float32: ~6e-6 measured)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    for name, want in native.items():
        for a, b in zip(portable[name], want, strict=True):
            err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            assert err <= tol, f"{name}: largest difference {err:.2e} of the largest entry"
