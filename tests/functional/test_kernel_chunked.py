"""The cache-blocked feature-kernel node (``_kernel_chunked``): oracle, gradients, blocks, masks."""
import pytest
import torch

import attnopt.functional.kernel._blocked as kc
from attnopt.functional import dispatch
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention
from attnopt.functional.kernel.chunked import chunked_feature_kernel_attention
from attnopt.kernels import Linear, NonStationaryFourier, RandomFourier
from tests.reference import kernel as ref

EPS = 1e-5


def _inputs(seed, g=3, nq=5, nk=6, d=3, dv=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    pq = torch.randn(g, nq, d, generator=gen, dtype=dtype)
    pk = torch.randn(g, nk, d, generator=gen, dtype=dtype)
    v = torch.randn(g, nk, dv, generator=gen, dtype=dtype)
    m = torch.rand(g, 1, nk, generator=gen, dtype=dtype) + 0.05
    return pq, pk, m, v


def _oracle(pq, pk, m, v, eps=EPS):
    w = (pq @ pk.transpose(-2, -1)).square() + eps
    if m is not None:
        w = w * m
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / torch.where(den > 0, den, 1.0), 0.0)


# block sizes: several whole heads a block, one head a block, query rows of one head a block
BLOCKS = [1 << 18, 30, 12, 6, 1]


@pytest.mark.parametrize("block", BLOCKS)
def test_values_and_gradients_match_the_materialized_oracle(block, monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", block)
    pq, pk, m, v = (x.requires_grad_() for x in _inputs(block))
    out = chunked_feature_kernel_attention(pq, pk, m, v, EPS)
    expect = _oracle(pq, pk, m, v)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-13)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (pq, pk, m, v), go)
    want = torch.autograd.grad(expect, (pq, pk, m, v), go)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_and_partial_gradients(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 8)  # row blocks of one head
    pq, pk, m, v = _inputs(1, g=2, nq=4, nk=5)
    args = [x.clone().requires_grad_() for x in (pq, pk, m, v)]
    assert torch.autograd.gradcheck(lambda *a: chunked_feature_kernel_attention(*a, EPS), args)
    # only some inputs need a gradient: each branch of the backward alone
    for i in range(4):
        xs = [x.clone().requires_grad_(j == i) for j, x in enumerate((pq, pk, m, v))]
        out = chunked_feature_kernel_attention(*xs, EPS)
        (grad,) = torch.autograd.grad(out.sum(), xs[i])
        ys = [x.clone().requires_grad_(j == i) for j, x in enumerate((pq, pk, m, v))]
        (want,) = torch.autograd.grad(_oracle(*ys).sum(), ys[i])
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_double_backward_is_exact(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 10)
    args = [x.requires_grad_() for x in _inputs(2, g=2, nq=3, nk=4, d=2)]
    assert torch.autograd.gradgradcheck(lambda *a: chunked_feature_kernel_attention(*a, EPS), args)


def test_no_key_weight_broadcast_batch_and_dead_rows_float32(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 9)
    pq, pk, m, v = _inputs(3, g=4, dtype=torch.float32)
    pq4 = pq.view(2, 2, 5, 3)
    pk_shared = pk[:1].view(1, 1, 6, 3)  # keys broadcast over the batch dimensions
    out = chunked_feature_kernel_attention(pq4, pk_shared, None, v.view(2, 2, 6, 2), EPS)
    torch.testing.assert_close(out, _oracle(pq4, pk_shared, None, v.view(2, 2, 6, 2)))
    m = m.clone()
    m[1] = 0.0  # every key of head 1 dropped: its rows are zeros, never NaN
    pq, pk, m, v = (x.requires_grad_() for x in (pq, pk, m, v))
    out = chunked_feature_kernel_attention(pq, pk, m, v, EPS)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, _oracle(pq, pk, m, v))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (pq, pk, m, v))


@pytest.mark.parametrize("name", ["linear", "rff", "nsf"])
def test_kernel_attention_streaming_path_matches_the_reference(name, monkeypatch):
    """Sizes above the crossover (forced to 0) take the blocked node: oracle and gradcheck."""
    monkeypatch.setitem(dispatch.CROSSOVERS, "kernel", dict.fromkeys(("float32", "float64", "half"), 0))
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 7)
    gen = torch.Generator().manual_seed(5)
    d = 4
    w1, w2 = (torch.randn(6, d, generator=gen, dtype=torch.float64) * 0.6 for _ in range(2))
    kern, sim = {
        "linear": (Linear(), lambda x, y: ref.linear(x, y, d**-0.5)),
        "rff": (RandomFourier(w1), lambda x, y: ref.random_fourier(x, y, w1)),
        "nsf": (NonStationaryFourier(w1, w2), lambda x, y: ref.nonstationary_fourier(x, y, w1, w2)),
    }[name]
    q, k, v = (torch.randn(1, 2, *s, generator=gen, dtype=torch.float64) for s in ((5, d), (6, d), (6, 2)))
    keep = torch.tensor([True, False, True, True, False, True]).view(1, 1, 1, 6)
    out = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5, attn_mask=keep)
    assert dispatch.last_dispatch["kernel"] == "streaming"
    for h in range(2):
        w = ref.kernel_weights(q[0, h], k[0, h], sim, squared=True, p=1.5, scale=d**-0.5, eps=EPS,
                               mask=keep[0, 0].expand(5, 6))
        torch.testing.assert_close(out[0, h], w @ v[0, h], rtol=1e-9, atol=1e-12)
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: kernel_attention(a, b, c, kernel=kern, magnitude_p=1.5, attn_mask=keep), args
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(("g", "nq", "nk"), [(3, 5, 6), (64, 512, 512), (2, 4096, 2048), (1, 1, 1)])
def test_blocks_cover_every_score_once(device, g, nq, nk):
    """Blocks tile heads × query rows exactly; on the CPU within BLOCK_ELEMS (or one whole block up
    to WHOLE_ELEMS), off it (no device needed: only the torch.device is read) DEVICE_BLOCK_ELEMS."""
    blocks = kc._blocks(g, nq, nk, torch.device(device))
    seen = torch.zeros(g, nq, dtype=torch.int64)
    for h0, h1, r0, r1 in blocks:
        seen[h0:h1, r0:r1] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    whole, size = (THRESHOLDS.kernel_whole_elements, THRESHOLDS.kernel_block_elements) if device == "cpu" \
        else (THRESHOLDS.kernel_device_block_elements,) * 2
    if g * nq * nk <= whole:
        assert blocks == [(0, g, 0, nq)]
    else:
        assert all((h1 - h0) * (r1 - r0) * nk <= max(size, nk) for h0, h1, r0, r1 in blocks)


@pytest.mark.parametrize("magnitude_p", [2.0, 1.5])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name", ["linear", "rff"])
def test_torch_func_grad_takes_the_plain_ops_and_matches_autograd(name, streaming, magnitude_p, monkeypatch):
    """torch.func's wrapped tensors have no storage for the fused / blocked nodes (old-style
    autograd Functions): they take the plain-op path, with the same gradient."""
    if streaming:
        monkeypatch.setitem(dispatch.CROSSOVERS, "kernel", dict.fromkeys(("float32", "float64", "half"), 0))
    gen = torch.Generator().manual_seed(9)
    pts = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    kern = Linear() if name == "linear" else RandomFourier(pts)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    keep = torch.tensor([True, True, False, True, True]).view(1, 1, 1, 5)

    def loss(q, k):  # p = 1.5: the L^p magnitude's own autograd Function under torch.func too
        return kernel_attention(q, k, v, kernel=kern, magnitude_p=magnitude_p, attn_mask=keep).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(q, k)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss(qg, kg).backward()
    torch.testing.assert_close(got, (qg.grad, kg.grad), rtol=1e-10, atol=1e-12)
