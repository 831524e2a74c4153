"""kernel_attention(mode="linear"): equal to the quadratic mode, causal prefix sums, masks, grads."""
import pytest
import torch

import attnopt.functional.kernel_linear as kl
from attnopt.functional.kernel import kernel_attention
from attnopt.kernels import RBF, Linear, NonStationaryFourier, Periodic, RandomFourier

D = 4


def _w(seed, r=5, d=D, scale=0.6):
    return torch.randn(r, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _qkv(seed, b=2, h=2, n=9, nk=None, d=D, dv=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, nk or n, d, generator=g, dtype=dtype)
    return q, k, torch.randn(b, h, nk or n, dv, generator=g, dtype=dtype)


KERNELS = {
    "rff": lambda: RandomFourier(_w(1)),
    "nsf": lambda: NonStationaryFourier(_w(2), _w(3)),
    "linear": lambda: Linear(),
    "per-head": lambda: RandomFourier(_w(4, r=8).view(2, 4, D)),
}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(kl, "_CAUSAL_CHUNK", 4)
    monkeypatch.setattr(kl, "_KEY_CHUNK", 5)
    monkeypatch.setattr(kl, "_CHUNK_ELEMS", 1)  # chunks of _KEY_CHUNK rows


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("p,eps", [(2.0, 0.0), (1.0, 1e-5), (None, 1e-5), (0.7, 0.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_equals_quadratic(small_chunks, name, p, eps, causal):
    q, k, v = _qkv(0, n=11)
    kern = KERNELS[name]()
    quad = kernel_attention(q, k, v, kernel=kern, magnitude_p=p, eps=eps, is_causal=causal)
    lin = kernel_attention(q, k, v, kernel=kern, magnitude_p=p, eps=eps, is_causal=causal, mode="linear")
    torch.testing.assert_close(lin, quad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_and_fully_masked(small_chunks, causal):
    q, k, v = _qkv(1, n=10)
    keep = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., :3] = False  # causal rows 0..2 of batch 0 see nothing
    keep[1, ..., 6:] = False
    kern = KERNELS["nsf"]()
    quad = kernel_attention(q, k, v, kernel=kern, attn_mask=keep, is_causal=causal)
    lin = kernel_attention(q, k, v, kernel=kern, attn_mask=keep, is_causal=causal, mode="linear")
    torch.testing.assert_close(lin, quad, rtol=1e-9, atol=1e-11)
    if causal:
        assert (lin[0, :, :3] == 0).all()


def test_nq_differs_from_nk_noncausal():
    q, k, v = _qkv(2, n=4, nk=13)
    kern = KERNELS["rff"]()
    torch.testing.assert_close(
        kernel_attention(q, k, v, kernel=kern, mode="linear"), kernel_attention(q, k, v, kernel=kern)
    )


def test_large_magnitudes_are_stable(small_chunks):
    q, k, v = _qkv(3, n=12, dtype=torch.float32)
    k = k * 30  # s‖k‖²/2 ≈ 1e3 >> 88: exp would overflow float32 without the shift
    for causal in (False, True):
        lin = kernel_attention(q, k, v, kernel=KERNELS["rff"](), is_causal=causal, mode="linear")
        quad = kernel_attention(q, k, v, kernel=KERNELS["rff"](), is_causal=causal)
        gold = kernel_attention(q.double(), k.double(), v.double(), kernel=KERNELS["rff"](), is_causal=causal)
        assert torch.isfinite(lin).all()
        err_lin, err_quad = (lin.double() - gold).abs().max(), (quad.double() - gold).abs().max()
        assert err_lin < max(1e-3, 20 * err_quad)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(small_chunks, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(4, b=1, h=1, n=6, d=2, dv=2))
    w = _w(5, r=2, d=2).requires_grad_()
    fn = lambda a, b, c, ww: kernel_attention(  # noqa: E731
        a, b, c, kernel=RandomFourier(ww), magnitude_p=1.5, is_causal=causal, mode="linear"
    )
    assert torch.autograd.gradcheck(fn, (q, k, v, w), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_no_nan(dtype):
    q, k, v = _qkv(6, n=16, dtype=torch.float32)
    kern = RandomFourier(_w(1).float())
    for causal in (False, True):
        out = kernel_attention(
            q.to(dtype), (k * 40).to(dtype), v.to(dtype), kernel=kern, is_causal=causal, mode="linear"
        )
        ref = kernel_attention(q.to(dtype).double(), (k * 40).to(dtype).double(), v.to(dtype).double(),
                               kernel=kern, is_causal=causal)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() < 0.05


def test_bad_inputs():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match="feature map"):
        kernel_attention(q, k, v, kernel=RBF(), mode="linear")
    with pytest.raises(ValueError, match="feature map"):
        kernel_attention(q, k, v, kernel=Periodic(1.0), mode="linear")
    with pytest.raises(ValueError, match="key masks"):
        full = torch.ones(9, 9, dtype=torch.bool)
        kernel_attention(q, k, v, kernel=Linear(), mode="linear", attn_mask=full)
    q2, k2, v2 = _qkv(0, n=3, nk=5)
    with pytest.raises(ValueError, match="Nq == Nk"):
        kernel_attention(q2, k2, v2, kernel=Linear(), mode="linear", is_causal=True)
