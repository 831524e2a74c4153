"""User-supplied bounded feature kernels through ``kernel_attention``: the fused feature-kernel node.

A :class:`~attnopt.kernels.Kernel` subclass that is ``squared``, ``bounded`` and has
``features`` but no ``fourier_sets`` takes the generic feature node
(``_kernel_chunked._ChunkedFeatureKernel``: whole at short sequences, cache-sized blocks at
long ones). Checked in float64 against the loop oracle of ``tests/reference/kernel.py``
(values, masks, fully masked rows), with ``gradcheck`` through the node and the user's
feature map, and against the streaming path (blocks forced).
"""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.functional import dispatch
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention
from attnopt.kernels import RBF, Kernel, RandomFourier
from tests.reference import kernel as ref

D = 3


class Cosine(Kernel):
    """``f(q, k) = cos∠(q, k)``: features ``x/‖x‖``, so ``|f| ≤ 1``; negative, hence squared."""

    squared = True
    has_features = True
    bounded = True

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.features(q) @ self.features(k).transpose(-2, -1)


class PlainFourier(RandomFourier):
    """A random-Fourier kernel that does not declare its point sets: the generic node runs, and
    the spectral points get their gradients through the user's ``features``."""

    def fourier_sets(self) -> None:  # type: ignore[override]
        return None


def _cosine_ref(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x @ y) / math.sqrt(float(x @ x) * float(y @ y))


def _points(seed: int = 1, r: int = 4) -> torch.Tensor:
    return torch.randn(r, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.7


KERNELS = {
    "cosine": (Cosine, _cosine_ref),
    "plain-fourier": (lambda: PlainFourier(_points()), lambda x, y: ref.random_fourier(x, y, _points())),
}


def _qkv(seed: int, b: int = 2, h: int = 2, nq: int = 4, nk: int = 5, dv: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, nk, D, generator=g, dtype=torch.float64)
    return q, k, torch.randn(b, h, nk, dv, generator=g, dtype=torch.float64)


def _oracle(q, k, v, sim, *, p, eps, keep=None):
    """Loop oracle: weights of eq. 9 + 11 per (batch, head) times v; ``keep`` (B, Nk) bool."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            mask = None if keep is None else keep[b].expand(q.shape[2], -1)
            w = ref.kernel_weights(
                q[b, h], k[b, h], sim, squared=True, p=p, scale=D**-0.5, eps=eps, mask=mask
            )
            out[b, h] = w @ v[b, h]
    return out


def _fused(q, k, v, kern, **kw):
    """``kernel_attention`` that must take the materialized path's generic feature node."""
    out = kernel_attention(q, k, v, kernel=kern, **kw)
    assert dispatch.last_dispatch["kernel"] == "materialized"
    return out


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("p", [2.0, 1.0, None])
@pytest.mark.parametrize("masked", [False, True])
def test_values_match_the_oracle_and_the_streaming_path(name, p, masked, monkeypatch):
    import attnopt.functional.kernel.chunked as kc

    make, sim = KERNELS[name]
    q, k, v = _qkv(0)
    keep = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool) if masked else None
    mask = None if keep is None else keep.view(2, 1, 1, 5)
    calls = []
    original = kc._ChunkedFeatureKernel.apply
    monkeypatch.setattr(kc._ChunkedFeatureKernel, "apply", lambda *a: calls.append(1) or original(*a))
    out = _fused(q, k, v, make(), magnitude_p=p, attn_mask=mask, eps=1e-3)
    assert calls, "the generic fused feature node did not run"
    torch.testing.assert_close(out, _oracle(q, k, v, sim, p=p, eps=1e-3, keep=keep), rtol=1e-10, atol=1e-12)
    monkeypatch.setitem(dispatch.CROSSOVERS, "kernel", dict.fromkeys(("float32", "float64", "half"), 0))
    monkeypatch.setattr(THRESHOLDS, "kernel_whole_elements", 0)
    # blocks of query rows, F recomputed in the backward
    monkeypatch.setattr(THRESHOLDS, "kernel_block_elements", 7)
    streamed = kernel_attention(q, k, v, kernel=make(), magnitude_p=p, attn_mask=mask, eps=1e-3)
    assert dispatch.last_dispatch["kernel"] == "streaming"
    torch.testing.assert_close(out, streamed, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p", [2.0, 1.5, None])
def test_gradcheck_through_the_node_and_the_feature_map(p):
    q, k, v = (t.requires_grad_() for t in _qkv(1, b=1, nq=3, nk=4))
    keep = torch.tensor([True, True, False, True]).view(1, 1, 1, 4)
    pts = _points(2).requires_grad_()

    def fn(q, k, v, pts):
        a = _fused(q, k, v, PlainFourier(pts), magnitude_p=p, attn_mask=keep, eps=1e-3)
        b = _fused(q, k, v, Cosine(), magnitude_p=p, eps=1e-3)
        return a, b

    assert torch.autograd.gradcheck(fn, (q, k, v, pts))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    pts = _points(3).requires_grad_()
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False  # every key of sample 1 is masked: all its rows have no admissible key
    cases = [
        (Cosine(), _cosine_ref, ()),
        (PlainFourier(pts), lambda x, y: ref.random_fourier(x, y, pts.detach()), (pts,)),
    ]
    for kern, sim, params in cases:
        for p in (2.0, None):
            out = _fused(q, k, v, kern, magnitude_p=p, attn_mask=keep.view(2, 1, 1, 5))
            assert torch.equal(out[1], torch.zeros_like(out[1]))
            expect = _oracle(q.detach(), k.detach(), v.detach(), sim, p=p, eps=1e-5, keep=keep)
            torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
            grads = torch.autograd.grad(out.sum(), (q, k, v, *params))
            assert all(torch.isfinite(g).all() for g in grads)
            for g in grads[:3]:  # sample 1 has no output: nothing flows back to its inputs
                assert torch.equal(g[1], torch.zeros_like(g[1]))


def test_per_head_key_weights_and_broadcast_keys_and_half_precision():
    q, _, _ = _qkv(4, b=2, h=3)
    _, k, v = _qkv(5, b=1, h=3)  # keys and values shared by both samples (batch 1 broadcasts)
    keep = torch.rand(2, 3, 1, 5, generator=torch.Generator().manual_seed(0)) > 0.4  # per head
    keep[..., 0] = True
    kk, vv = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    out = _fused(q, k, v, Cosine(), magnitude_p=1.0, attn_mask=keep, eps=1e-4)
    for h in range(3):
        hs = slice(h, h + 1)
        expect = _oracle(q[:, hs], kk[:, hs], vv[:, hs], _cosine_ref, p=1.0, eps=1e-4, keep=keep[:, h, 0])
        torch.testing.assert_close(out[:, hs], expect, rtol=1e-10, atol=1e-12)
    small = (q[:, :1, :2].clone(), k[:, :1].clone(), v[:, :1].clone())  # batch 2 against batch 1
    assert torch.autograd.gradcheck(
        lambda a, b, c: _fused(a, b, c, Cosine(), magnitude_p=1.0, attn_mask=keep[:, :1], eps=1e-4),
        tuple(t.requires_grad_() for t in small),
    )
    for dt in (torch.float16, torch.bfloat16):
        args = [t.to(dt) for t in (q * 40, k * 40, v)]  # ‖k‖ large: the magnitude term overflows half
        low = kernel_attention(*args, kernel=Cosine(), magnitude_p=1.0, attn_mask=keep, eps=1e-4)
        assert low.dtype == dt and torch.isfinite(low).all()
        high = kernel_attention(*(t.double() for t in args), kernel=Cosine(), magnitude_p=1.0, attn_mask=keep,
                                eps=1e-4)
        assert (low.double() - high).abs().max() < 0.05


@pytest.mark.parametrize(
    ("make", "p"),
    [(Cosine, 2.0), (Cosine, 1.5), (lambda: PlainFourier(_points()), None), (lambda: RBF(), 1.5)],
)
def test_double_backward_is_exact(make, p):
    """``create_graph=True`` differentiates plain ops: the closed-form backwards use untracked
    forward intermediates, and their second derivatives were silently wrong (RBF p=1.5: the
    L^p magnitude node)."""
    q, k, v = (t.requires_grad_() for t in _qkv(6, b=1, h=1, nq=3, nk=4))
    keep = torch.tensor([True, True, False, True]).view(1, 1, 1, 4)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: kernel_attention(q, k, v, kernel=make(), magnitude_p=p, attn_mask=keep, eps=1e-3),
        (q, k, v),
        fast_mode=True,
    )


def test_fused_fourier_node_refuses_double_backward():
    q, k, v = (t.requires_grad_() for t in _qkv(6, b=1, h=1, nq=3, nk=4))
    out = kernel_attention(q, k, v, kernel=RandomFourier(_points()), magnitude_p=2.0)
    assert dispatch.last_dispatch["kernel"] == "materialized"
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
