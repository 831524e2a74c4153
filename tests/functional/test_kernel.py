"""kernel_attention / kernel_weights (quadratic mode): oracle, SDPA equivalence, properties, errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.kernels import RBF, Linear, NonStationaryFourier, Periodic, RandomFourier
from tests.reference import kernel as ref

D = 4


def _w(seed, r=6, d=D):
    return torch.randn(r, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.6


KERNELS = {
    "rbf": (lambda: RBF(1.4), lambda x, y: ref.rbf(x, y, 1.4), False),
    "periodic": (lambda: Periodic(3.0, 1.1), lambda x, y: ref.periodic(x, y, 3.0, 1.1), False),
    "linear": (lambda: Linear(), lambda x, y: ref.linear(x, y, D**-0.5), True),
    "rff": (lambda: RandomFourier(_w(1)), lambda x, y: ref.random_fourier(x, y, _w(1)), True),
    "nsf": (
        lambda: NonStationaryFourier(_w(2), _w(3)),
        lambda x, y: ref.nonstationary_fourier(x, y, _w(2), _w(3)),
        True,
    ),
}


def _qkv(seed, b=1, h=2, nq=3, nk=5, d=D, dv=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype)
    return q, k, torch.randn(b, h, nk, dv, generator=g, dtype=dtype)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, None])
@pytest.mark.parametrize("masked", [False, True])
def test_weights_match_float64_oracle(name, p, masked):
    make, oracle, squared = KERNELS[name]
    q, k, v = _qkv(0)
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(9)) > 0.3 if masked else None
    if mask is not None:
        mask[:, 0] = True
    eps = 1e-5 if squared else 0.0
    w = kernel_weights(q, k, kernel=make(), magnitude_p=p, attn_mask=mask, eps=eps)
    for h in range(2):
        expect = ref.kernel_weights(
            q[0, h], k[0, h], oracle, squared=squared, p=p, scale=D**-0.5, eps=eps, mask=mask
        )
        torch.testing.assert_close(w[0, h], expect, rtol=1e-9, atol=1e-12)
    out = kernel_attention(q, k, v, kernel=make(), magnitude_p=p, attn_mask=mask, eps=eps)
    torch.testing.assert_close(out, w @ v)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [False, True])
def test_rbf_with_l2_magnitude_equals_sdpa(dtype, tol, causal):
    q, k, v = _qkv(1, b=2, nq=6, nk=6, d=8, dv=3, dtype=dtype)
    expect = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    got = kernel_attention(q, k, v, kernel=RBF(), magnitude_p=2.0, is_causal=causal)
    torch.testing.assert_close(got, expect, rtol=tol, atol=tol)
    w = kernel_weights(q, k, kernel=RBF(8**0.25), is_causal=causal)
    torch.testing.assert_close(w @ v, expect, rtol=tol, atol=tol)


def test_rbf_only_has_no_magnitude():
    q, k, _ = _qkv(2)
    w = kernel_weights(q, k, kernel=RBF(), magnitude_p=None)
    rbf = torch.exp(-torch.cdist(q, k).pow(2) / (2 * math.sqrt(D)))
    torch.testing.assert_close(w, rbf / rbf.sum(-1, keepdim=True))


@pytest.mark.parametrize("p", [None, 1.0])
@pytest.mark.parametrize("masked", [False, True])
def test_rbf_key_bias_through_sdpa_matches_oracle_values_and_grads(p, masked):
    # dv = d: the SDPA form pads v with a zero column; gradients against the float64 oracle
    q, k, v = (t.requires_grad_() for t in _qkv(12, b=2, nq=5, nk=7, d=D, dv=D))
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.4 if masked else None
    if mask is not None:
        mask[:, 2] = True
    out = kernel_attention(q, k, v, kernel=RBF(), magnitude_p=p, attn_mask=mask)
    # the obvious autograd reference: α ∝ exp(−‖q−k‖²/(2√d)) · exp(s‖k‖_p²/2), masked, normalized
    logits = -(q.unsqueeze(-2) - k.unsqueeze(-3)).square().sum(-1) / (2 * D**0.5)
    if p is not None:
        logits = logits + 0.5 * D**-0.5 * k.abs().pow(p).sum(-1).pow(2 / p).unsqueeze(-2)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    expect = torch.softmax(logits, dim=-1) @ v
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(expect, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@given(st.integers(0, 10_000), st.sampled_from(list(KERNELS)), st.floats(0.3, 3.0))
def test_rows_are_distributions_and_masking_is_truncation(seed, name, p):
    make = KERNELS[name][0]
    q, k, v = _qkv(seed, nq=4, nk=6)
    w = kernel_weights(q, k, kernel=make(), magnitude_p=p)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    keep = torch.tensor([True, False, True, True, False, True])
    masked = kernel_attention(q, k, v, kernel=make(), magnitude_p=p, attn_mask=keep)
    trunc = kernel_attention(q, k[..., keep, :], v[..., keep, :], kernel=make(), magnitude_p=p)
    torch.testing.assert_close(masked, trunc)


def test_key_permutation_equivariance():
    q, k, v = _qkv(3, nk=6)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    for name in KERNELS:
        kern = KERNELS[name][0]()
        a = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5)
        b = kernel_attention(q, k[..., perm, :], v[..., perm, :], kernel=kern, magnitude_p=1.5)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", list(KERNELS))
def test_gradcheck(name):
    q, k, v = (t.requires_grad_() for t in _qkv(4, nq=2, nk=3))
    kern = KERNELS[name][0]()
    fn = lambda a, b, c: kernel_attention(a, b, c, kernel=kern, magnitude_p=1.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_sparsity_as_p_goes_to_zero_prop5():
    q, k, _ = _qkv(5, nq=8, nk=10, d=8)
    ps = (2.0, 1.0, 0.1)
    max_w = [kernel_weights(q, k, kernel=RBF(), magnitude_p=p).amax(-1).mean().item() for p in ps]
    assert max_w[0] < max_w[1] < max_w[2] and max_w[2] > 0.99


def test_fully_masked_row_is_zero_with_finite_grad():
    q, k, v = (t.requires_grad_() for t in _qkv(6))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    for kern in (RBF(), Periodic(2.0), RandomFourier(_w(1))):
        out = kernel_attention(q, k, v, kernel=kern, attn_mask=mask)
        assert (out[..., 1, :] == 0).all()
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(KERNELS))
def test_half_precision_no_nan_even_with_large_norms(dtype, name):
    q, k, v = _qkv(7, nq=4, nk=6, dtype=torch.float32)
    q, k = q * 60, k * 60  # ‖k‖²/(2√d) ≈ 3e3: exp overflows float32, let alone half
    kern = KERNELS[name][0]()  # float64 spectral points are cast to the inputs' compute dtype
    out = kernel_attention(q.to(dtype), k.to(dtype), v.to(dtype), kernel=kern, magnitude_p=0.7)
    assert out.dtype == dtype and torch.isfinite(out).all()
    w = kernel_weights(q.to(dtype), k.to(dtype), kernel=kern)
    assert torch.isfinite(w).all()
    ref64 = kernel_weights(q.to(dtype).double(), k.to(dtype).double(), kernel=kern)
    assert (w.float() - ref64.float()).abs().max() < 0.02


def test_bad_inputs():
    q, k, v = _qkv(0)
    with pytest.raises(TypeError, match="kernel"):
        kernel_attention(q, k, v, kernel="rbf")
    with pytest.raises(ValueError, match="magnitude_p"):
        kernel_attention(q, k, v, kernel=RBF(), magnitude_p=0.0)
    with pytest.raises(ValueError, match="eps"):
        kernel_attention(q, k, v, kernel=RBF(), eps=-1.0)
    with pytest.raises(ValueError, match="mode"):
        kernel_attention(q, k, v, kernel=RBF(), mode="fast")
    with pytest.raises(ValueError, match="scale"):
        kernel_weights(q, k, kernel=RBF(), scale=0.0)
    with pytest.raises(ValueError, match="attn_mask"):
        kernel_attention(q, k, v, kernel=RBF(), attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError):
        kernel_attention(q, k, v[..., :4, :], kernel=RBF())


def test_exp_free_path_chunked_equals_log_domain(monkeypatch):

    q, k, v = _qkv(11, nq=9, nk=7)
    keep = torch.tensor([True, True, False, True, True, True, False]).view(1, 1, 1, 7)
    kern = KERNELS["nsf"][0]()
    full = kernel_attention(q, k, v, kernel=kern, magnitude_p=0.9, attn_mask=keep)
    monkeypatch.setattr(THRESHOLDS, "kernel_direct_chunk_elements", 7)  # one query row per chunk
    with torch.no_grad():  # in-place branch
        chunked = kernel_attention(q, k, v, kernel=kern, magnitude_p=0.9, attn_mask=keep)
    # the log-domain path, forced by a query-dependent (but equivalent) mask
    logdom = kernel_attention(q, k, v, kernel=kern, magnitude_p=0.9, attn_mask=keep.expand(1, 1, 9, 7))
    torch.testing.assert_close(chunked, logdom)
    torch.testing.assert_close(full, logdom)


@pytest.mark.parametrize("masked", [False, True])
def test_linear_kernel_takes_materialized_path_and_matches_oracle(masked):
    from attnopt.functional import dispatch

    q, k, v = _qkv(3)
    mask = torch.rand(1, 5, generator=torch.Generator().manual_seed(4)) > 0.4 if masked else None
    if mask is not None:
        mask[:, 0] = True
    out = kernel_attention(q, k, v, kernel=Linear(), magnitude_p=2.0, attn_mask=mask)
    assert dispatch.last_dispatch["kernel"] == "materialized"
    for h in range(2):
        w = ref.kernel_weights(
            q[0, h], k[0, h], lambda x, y: ref.linear(x, y, D**-0.5), squared=True, p=2.0,
            scale=D**-0.5, eps=1e-5, mask=None if mask is None else mask.expand(3, 5),
        )
        torch.testing.assert_close(out[0, h], w @ v[0, h], rtol=1e-9, atol=1e-12)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: kernel_attention(a, b, c, kernel=Linear(), magnitude_p=2.0, attn_mask=mask),
        (qg, kg, vg),
    )


def test_linear_kernel_huge_scores_fall_back_to_log_domain():
    from attnopt.functional import dispatch

    q, k, v = _qkv(5, dtype=torch.float32)
    q = q * 1e14  # f² ~ 1e28 > ε·eps/tiny: the direct form could lose keys whose m_j underflows
    out = kernel_attention(q, k, v, kernel=Linear(), magnitude_p=2.0)
    assert dispatch.last_dispatch["kernel"] == "streaming"
    q64, k64, v64 = (x.double() for x in (q, k, v))
    expect = kernel_attention(q64, k64, v64, kernel=Linear(), magnitude_p=2.0)
    torch.testing.assert_close(out, expect.float(), rtol=1e-4, atol=1e-5)
