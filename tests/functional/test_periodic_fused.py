"""The fused Expsin (periodic kernel × magnitude) node behind kernel_attention vs float64 oracles,
on its C passes (``_periodic_native``) and on its PyTorch fallback (``native_or_torch``)."""
import math

import pytest
import torch

import attnopt.functional.kernel.periodic as pf
from attnopt.functional import dispatch
from attnopt.functional._softmax import safe_softmax
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention
from attnopt.kernels import Periodic
from tests.reference import kernel as ref

# (CHUNK_BYTES, SAVE_BYTES): one chunk with θ and W saved; several chunks, recomputed in the backward
LAYOUTS = [(1 << 18, 1 << 40), (256, 0)]


@pytest.fixture(params=LAYOUTS, ids=["one-chunk-saved", "chunks-recomputed"])
def layout(request, monkeypatch):
    chunk, save = request.param
    monkeypatch.setattr(THRESHOLDS, "periodic_chunk_bytes", chunk)
    monkeypatch.setattr(THRESHOLDS, "periodic_save_bytes", save)
    return request.param


def _qkv(seed, b=2, h=2, nq=4, nk=5, d=3, dv=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g, dtype=dtype).requires_grad_(),
            torch.randn(b, h, nk, d, generator=g, dtype=dtype).requires_grad_(),
            torch.randn(b, h, nk, dv, generator=g, dtype=dtype).requires_grad_())


def _masks(b, nq, nk):
    """name -> (attn_mask as kernel_attention takes it, is_causal, bool keep (b, 1, nq, nk))."""
    g = torch.Generator().manual_seed(7)
    keys = torch.ones(b, 1, 1, nk, dtype=torch.bool)
    keys[1, ..., 2:] = False
    rows = torch.rand(b, 1, nq, nk, generator=g) > 0.4
    rows[..., 0] = True
    dead = rows.clone()
    dead[0, 0, 1] = False  # one query with no admissible key
    pos = torch.arange(max(nq, nk))
    pad = (pos == 2) | (pos == 3)  # the models' key ∪ query padding
    padded = (~pad[None, :nq, None] & ~pad[None, None, :nk]).expand(b, nq, nk).unsqueeze(1).clone()
    tri = torch.ones(nq, nk, dtype=torch.bool).tril().expand(b, 1, nq, nk)
    full = torch.ones(b, 1, nq, nk, dtype=torch.bool)
    return {
        "none": (None, False, full),
        "keys": (keys, False, keys.expand(b, 1, nq, nk)),
        "rows": (rows, False, rows),
        "dead-row": (dead, False, dead),
        "padding": (padded, False, padded),
        "causal": (None, True, tri),
        "float": (torch.randn(nq, nk, generator=g, dtype=torch.float64), False, full),
    }


def _oracle(q, k, v, period, lengthscale, p, keep, additive=None):
    """Loop oracle (tests/reference/kernel.py) for the weights, times v; float64."""
    b, h = q.shape[:2]
    d = q.shape[-1]
    ls = lengthscale if lengthscale is not None else d**0.25
    out = torch.zeros(b, h, q.shape[2], v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            w = ref.kernel_weights(q[bi, hi].detach(), k[bi, hi].detach(),
                                   lambda x, y: ref.periodic(x, y, period, ls), squared=False, p=p,
                                   scale=d**-0.5, mask=keep[bi, 0])
            if additive is not None:  # an additive float mask multiplies the weights by exp(m)
                w = w * additive.exp()
                total = w.sum(-1, keepdim=True)
                w = torch.where(total > 0, w / total, 0.0)
            out[bi, hi] = w @ v[bi, hi].detach()
    return out


def _naive(q, k, v, kern, p, mask, causal):
    """The log-domain composition by autograd (no fused node), float64."""
    d = q.shape[-1]
    c = kern.inv_sq_lengthscale(d)
    r = (q.unsqueeze(-2) - k.unsqueeze(-3)).pow(2).sum(-1).clamp_min(1e-300).sqrt()
    logits = (torch.cos(r * 2 * math.pi / kern.period) - 1) * c
    if p is not None:
        logits = logits + (k.abs().pow(p).sum(-1).pow(2 / p) * d**-0.5 / 2).unsqueeze(-2)
    if mask is not None:
        logits = logits + (torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
                           if mask.dtype == torch.bool else mask)
    if causal:
        tri = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        logits = logits.masked_fill(~tri, -math.inf)
    return safe_softmax(logits, dim=-1) @ v


@pytest.mark.parametrize("mask_name", ["none", "keys", "rows", "dead-row", "padding", "causal", "float"])
@pytest.mark.parametrize("p", [2.0, 1.5])  # p = None: tests/functional/test_kernel.py
def test_matches_loop_oracle_and_autograd_composition(native_or_torch, layout, mask_name, p):
    q, k, v = _qkv(1, nq=4, nk=5)
    mask, causal, keep = _masks(2, 4, 5)[mask_name]
    kern = Periodic(2.5, 1.3)
    out = kernel_attention(q, k, v, kernel=kern, magnitude_p=p, attn_mask=mask, is_causal=causal)
    assert dispatch.last_dispatch["kernel"] == "materialized"
    additive = mask if mask_name == "float" else None
    torch.testing.assert_close(out, _oracle(q, k, v, 2.5, 1.3, p, keep, additive), rtol=1e-10, atol=1e-12)
    expect = _naive(q, k, v, kern, p, mask, causal)
    gout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), gout)
    want = torch.autograd.grad(expect, (q, k, v), gout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    if mask_name == "dead-row":
        assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))


@pytest.mark.parametrize("mask_name", ["keys", "dead-row", "causal"])
def test_gradcheck(native_or_torch, layout, mask_name):
    q, k, v = _qkv(2, b=2, h=1, nq=3, nk=4)
    mask, causal, _ = _masks(2, 3, 4)[mask_name]
    kern = Periodic(3.0)

    def fn(a, b, c):
        return kernel_attention(a, b, c, kernel=kern, attn_mask=mask, is_causal=causal)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_with_an_lp_magnitude_and_broadcast_batch(native_or_torch, layout):
    q, k, v = _qkv(3, b=2, h=2, nq=3, nk=4)
    k1, v1 = k[:1].detach().requires_grad_(), v[:1].detach().requires_grad_()  # (1, H, …) broadcast

    def fn(a, b, c):
        return kernel_attention(a, b, c, kernel=Periodic(2.0, 0.9), magnitude_p=1.5)

    assert torch.autograd.gradcheck(fn, (q, k1, v1))


def test_coincident_query_and_key_has_the_kernels_zero_slope(native_or_torch, layout):
    """θ = 0 (q_i = k_j): sin θ/θ → 1 there, so the gradient is finite and the composition's."""
    q, _, v = _qkv(4, nq=4, nk=4)
    k = q.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: kernel_attention(a, b, c, kernel=Periodic(2 * math.pi)), (q, k, v))


def test_forward_without_grad_is_the_same(native_or_torch, layout):
    q, k, v = _qkv(5, b=3, h=2, nq=6, nk=7)
    mask, causal, _ = _masks(3, 6, 7)["rows"]
    with torch.no_grad():
        a = kernel_attention(q, k, v, kernel=Periodic(3.0), attn_mask=mask, is_causal=True)
    b = kernel_attention(q, k, v, kernel=Periodic(3.0), attn_mask=mask, is_causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tiny_lengthscale_takes_the_log_domain_path_in_float32():
    q, k, v = _qkv(6)
    kern = Periodic(2.0, 0.1)  # c = 100: exp(c cos θ) could underflow whole float32 rows
    assert pf.MAX_C[torch.float32] < kern.inv_sq_lengthscale(3) < pf.MAX_C[torch.float64]
    keep = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    expect = _oracle(q, k, v, 2.0, 0.1, 2.0, keep)
    out = kernel_attention(q, k, v, kernel=kern)  # float64: fused, weights spanning e^-200
    assert dispatch.last_dispatch["kernel"] == "materialized"
    torch.testing.assert_close(out, expect, rtol=1e-9, atol=1e-12)
    out32 = kernel_attention(*(t.float() for t in (q, k, v)), kernel=kern)
    assert dispatch.last_dispatch["kernel"] == "streaming"
    torch.testing.assert_close(out32.double(), expect, rtol=1e-4, atol=1e-4)


def test_a_float_mask_with_grad_takes_the_autograd_path():
    q, k, v = _qkv(7)
    mask = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    out = kernel_attention(q, k, v, kernel=Periodic(2.0), attn_mask=mask)
    assert dispatch.last_dispatch["kernel"] == "streaming"
    (gm,) = torch.autograd.grad(out.sum(), (mask,))
    assert torch.isfinite(gm).all() and gm.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision_error_is_bounded_by_the_naive_one(native_or_torch, dtype):
    q, k, v = (t.detach() for t in _qkv(8, b=2, h=4, nq=32, nk=32, d=16, dv=8))
    q, k = q * 0.5, k * 0.5
    gold = _naive(q, k, v, Periodic(2 * math.pi), 2.0, None, True)
    low = [t.to(dtype) for t in (q, k, v)]
    got = kernel_attention(*low, kernel=Periodic(2 * math.pi), is_causal=True)
    assert got.dtype == dtype and torch.isfinite(got).all()
    naive = _naive(*(t.float() for t in low), Periodic(2 * math.pi), 2.0, None, True).to(dtype)
    err = (got.double() - gold).abs().max()
    naive_err = (naive.double() - gold).abs().max()
    assert err <= 4 * naive_err + 1e-6
