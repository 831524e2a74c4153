"""``dropout_p`` of every functional attention: SDPA's convention (inverted dropout on the weights).

For each mechanism: ``dropout_p = 0`` is the call without it, bit for bit; ``dropout_p > 0`` equals
``dropout(weights) @ v`` drawn from the same seed (values and gradients), its mean over many draws
is the output without dropout (E[out] = π v), and a bad ``dropout_p`` is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnopt import functional as AF
from attnopt.dual.mem_attention import mem_attention, mem_weights
from attnopt.kernels import RBF, Linear, Periodic

W = torch.tensor([0.3, 0.8], dtype=torch.float64)  # per head


def _mask(nq: int, nk: int) -> torch.Tensor:
    m = torch.ones(nq, nk, dtype=torch.bool)
    m[0, 1:] = False  # one row sees one key only
    m[:, -1] = False  # a key nobody sees
    return m


def _ot_attn(q, k, v, **kw):
    return AF.ot_attention(q, k, bank_values=v, gamma=1.5, **kw)


def _ot_w(q, k):
    return AF.ot_weights(q, k, gamma=1.5)


# name -> (attention(q, k, v, **kw), weights(q, k), masked?)
CASES = {
    "generalized": (lambda q, k, v, **kw: AF.generalized_attention(q, k, v, attn_mask=_mask(5, 6), **kw),
                    lambda q, k: AF.generalized_weights(q, k, attn_mask=_mask(5, 6))),
    "dnas": (lambda q, k, v, **kw: AF.doubly_normalized_attention(q, k, v, attn_mask=_mask(5, 6), **kw),
             lambda q, k: AF.doubly_normalized_weights(q, k, attn_mask=_mask(5, 6))),
    "sinkhorn": (lambda q, k, v, **kw: AF.doubly_normalized_attention(q, k, v, iterations=3, is_causal=True,
                                                                      **kw),
                 lambda q, k: AF.doubly_normalized_weights(q, k, iterations=3, is_causal=True)),
    "hnas": (lambda q, k, v, **kw: AF.hybrid_normalized_attention(q, k, v, W, **kw),
             lambda q, k: AF.hybrid_normalized_weights(q, k, W)),
    "sparsemax": (lambda q, k, v, **kw: AF.regularized_attention(q, k, v, regularizer=AF.SquaredL2(),
                                                                 attn_mask=_mask(5, 6), **kw),
                  lambda q, k: AF.regularized_attention_weights(q, k, regularizer=AF.SquaredL2(),
                                                                attn_mask=_mask(5, 6))),
    "entmax": (lambda q, k, v, **kw: AF.regularized_attention(q, k, v, regularizer=AF.Tsallis(1.5),
                                                              locality=0.5, **kw),
               lambda q, k: AF.regularized_attention_weights(q, k, regularizer=AF.Tsallis(1.5),
                                                             locality=0.5)),
    "softmax-reg": (lambda q, k, v, **kw: AF.regularized_attention(q, k, v, **kw),
                    lambda q, k: AF.regularized_attention_weights(q, k)),
    "rbf": (lambda q, k, v, **kw: AF.kernel_attention(q, k, v, kernel=RBF(), magnitude_p=None, **kw),
            lambda q, k: AF.kernel_weights(q, k, kernel=RBF(), magnitude_p=None)),
    "expsin": (lambda q, k, v, **kw: AF.kernel_attention(q, k, v, kernel=Periodic(6.0), **kw),
               lambda q, k: AF.kernel_weights(q, k, kernel=Periodic(6.0))),
    "linear-mode": (lambda q, k, v, **kw: AF.kernel_attention(q, k, v, kernel=Linear(), mode="linear", **kw),
                    lambda q, k: AF.kernel_weights(q, k, kernel=Linear())),
    "ot": (_ot_attn, _ot_w),
    "mem": (lambda q, k, v, **kw: mem_attention(q, k, v, attn_mask=_mask(5, 6), **kw),
            lambda q, k: mem_weights(q, k, attn_mask=_mask(5, 6))),
}


def _inputs(batch: int = 2, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    q, k, v = (x.expand(batch, -1, -1, -1).clone().requires_grad_(grad) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_zero_is_unchanged(name):
    attn, _ = CASES[name]
    q, k, v = _inputs()
    assert torch.equal(attn(q, k, v, dropout_p=0.0), attn(q, k, v))


@pytest.mark.parametrize("name", [n for n in CASES if n != "generalized"])  # SDPA draws its own mask
def test_dropout_is_dropout_of_the_weights(name):
    """Same seed: the op equals ``F.dropout(weights) @ v``, in value and in gradient."""
    attn, weights = CASES[name]
    q, k, v = _inputs(grad=True)
    torch.manual_seed(7)
    out = attn(q, k, v, dropout_p=0.4)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.manual_seed(7)
    ref = F.dropout(weights(q, k), p=0.4) @ v
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    assert (out != attn(q, k, v)).any()  # some weight really was dropped


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_mean_is_the_output_without_dropout(name):
    """E[out] = π v: the mean over 1500 independent draws is within 5 standard errors."""
    attn, _ = CASES[name]
    n = 1500
    q, k, v = _inputs(batch=n, seed=1)
    torch.manual_seed(3)
    out = attn(q, k, v, dropout_p=0.3)
    ref = attn(q[:1], k[:1], v[:1])[0]
    err = (out.mean(0) - ref).abs()
    se = out.std(0) / n**0.5
    assert bool((err <= 5 * se + 1e-9).all()), float((err / (se + 1e-12)).max())
    assert float(se.max()) > 0  # dropout did act


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan")])
def test_bad_dropout_p_is_refused(name, bad):
    attn, _ = CASES[name]
    with pytest.raises(ValueError, match="dropout_p"):
        attn(*_inputs(), dropout_p=bad)
