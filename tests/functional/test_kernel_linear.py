"""kernel_attention(mode="linear"): equal to the quadratic mode, causal prefix sums, masks, grads."""
import math

import pytest
import torch

from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention, split_key_query_mask
from attnopt.kernels import RBF, Linear, NonStationaryFourier, Periodic, RandomFourier
from tests.reference import kernel as ref

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
    monkeypatch.setattr(THRESHOLDS, "kernel_linear_causal_chunk", 4)
    monkeypatch.setattr(THRESHOLDS, "kernel_linear_key_chunk", 5)
    monkeypatch.setattr(THRESHOLDS, "kernel_linear_chunk_elements", 1)  # chunks of _KEY_CHUNK rows


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
    with pytest.raises(ValueError, match="needs a key mask"):
        full = torch.ones(9, 9, dtype=torch.bool).tril()  # query-dependent: causal as a mask
        kernel_attention(q, k, v, kernel=Linear(), mode="linear", attn_mask=full)
    q2, k2, v2 = _qkv(0, n=3, nk=5)
    with pytest.raises(ValueError, match="Nq == Nk"):
        kernel_attention(q2, k2, v2, kernel=Linear(), mode="linear", is_causal=True)


def _padding_mask(b, n, lengths):
    """The models' mask: key padding ∪ query padding, (B, 1, N, N), True = take part."""
    real = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)
    return (real[:, None, :, None] & real[:, None, None, :]).expand(b, 1, n, n)


def _feature_reference(q, k, v, kern, p, keep, eps):
    """Loop oracle with the explicit feature map: Σ_j ((φ_iᵀφ_j)² + ε)·e^{s‖k_j‖_p²/2}·v_j / Σ_j …."""
    phi_q, phi_k = kern.features(q), kern.features(k)
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    s = q.shape[-1] ** -0.5
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                num, den = torch.zeros(v.shape[-1], dtype=torch.float64), 0.0
                for j in range(n):
                    if not keep[bi, 0, i, j]:
                        continue
                    wij = (float(phi_q[bi, hi, i] @ phi_k[bi, hi, j]) ** 2 + eps) * math.exp(
                        s * ref.lp_norm_sq(k[bi, hi, j], p) / 2)
                    num, den = num + wij * v[bi, hi, j], den + wij
                if den > 0:
                    out[bi, hi, i] = num / den
    return out


@pytest.mark.parametrize("name", ["nsf", "rff", "per-example"])
def test_padded_mask_linear_equals_feature_reference_and_quadratic(name):
    """Key ∪ query padding (as the models pass it): linear = loop oracle = quadratic, grads too."""
    q, k, v = (t.requires_grad_() for t in _qkv(7, n=7))
    if name == "per-example":  # (B, H, R, d) points, as the IKA modules sample them
        kern = NonStationaryFourier(_w(8, r=12).view(2, 2, 3, D), _w(9, r=12).view(2, 2, 3, D))
    else:
        kern = KERNELS[name]()
    keep = _padding_mask(2, 7, [5, 7])
    lin = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5, attn_mask=keep, mode="linear")
    quad = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5, attn_mask=keep)
    oracle = _feature_reference(q.detach(), k.detach(), v.detach(), kern, 1.5, keep, 1e-5)
    torch.testing.assert_close(lin, oracle, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(quad, oracle, rtol=1e-9, atol=1e-11)
    assert (lin[0, :, 5:] == 0).all()  # padded queries: zero rows in both modes
    go = torch.randn_like(lin)
    for a, b in zip(torch.autograd.grad(lin, (q, k, v), go), torch.autograd.grad(quad, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_padded_mask_additive_and_all_padded_example():
    q, k, v = _qkv(10, n=6)
    keep = _padding_mask(2, 6, [0, 4])  # example 0 is all padding
    add = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    kern = KERNELS["nsf"]()
    lin = kernel_attention(q, k, v, kernel=kern, attn_mask=add, mode="linear")
    quad = kernel_attention(q, k, v, kernel=kern, attn_mask=keep)
    torch.testing.assert_close(lin, quad, rtol=1e-9, atol=1e-11)
    assert (lin[0] == 0).all() and torch.isfinite(lin).all()


def test_split_key_query_mask():
    keep = _padding_mask(2, 5, [3, 5])
    add = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    key, dead = split_key_query_mask(add)
    assert key.shape == (2, 1, 1, 5) and dead.shape == (2, 1, 5, 1)
    assert torch.equal(torch.isneginf(key[0, 0, 0]), torch.tensor([False] * 3 + [True] * 2))
    assert torch.equal(dead[0, 0, :, 0], torch.tensor([False] * 3 + [True] * 2)) and not dead[1].any()
    add[1, 0, 2, 1] = float("-inf")  # one query sees a different key set
    with pytest.raises(ValueError, match="query-dependent"):
        split_key_query_mask(add)
