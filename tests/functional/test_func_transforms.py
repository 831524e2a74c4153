"""DNAS / HNAS / Sinkhorn-K and sparsemax / entmax attention under ``torch.func`` transforms.

The fused paths are ctx-style ``autograd.Function``\\ s without a vmap rule (and read values
during dispatch); under a transform the ops take their plain differentiable PyTorch path, so
``vmap`` must equal the batched call, ``grad`` / ``jacrev`` / per-example ``vmap(grad)`` the
autograd results of the fast path, all in float64 to rounding.
"""
from __future__ import annotations

import pytest
import torch
from torch import func

from attnopt.functional import (
    doubly_normalized_attention,
    hybrid_normalized_attention,
    regularized_attention,
)
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from attnopt.nn import make_attention

TOL = {"rtol": 1e-9, "atol": 1e-11}
W = torch.tensor(0.3, dtype=torch.float64)
W_HEADS = torch.tensor([0.2, 0.9], dtype=torch.float64)


def _dn(impl, iterations):
    return lambda q, k, v, m, c: doubly_normalized_attention(
        q, k, v, iterations=iterations, attn_mask=m, causal="plan", is_causal=c, impl=impl)


def _hn(impl, weight, iterations=1):
    return lambda q, k, v, m, c: hybrid_normalized_attention(
        q, k, v, weight, iterations=iterations, attn_mask=m, causal="plan", is_causal=c, impl=impl)


def _reg(impl, reg):
    return lambda q, k, v, m, c: regularized_attention(
        q, k, v, regularizer=reg, attn_mask=m, is_causal=c, impl=impl)


OPS = {
    "dnas-auto": _dn("auto", 1),
    "dnas-materialized": _dn("materialized", 1),
    "dnas-streaming": _dn("streaming", 1),
    "sinkhorn3-materialized": _dn("materialized", 3),
    "sinkhorn3-streaming": _dn("streaming", 3),
    "hnas-materialized": _hn("materialized", W),
    "hnas-streaming-per-head": _hn("streaming", W_HEADS),
    "hnas2-auto": _hn("auto", W_HEADS, 2),
    "sparsemax-materialized": _reg("materialized", SquaredL2()),
    "sparsemax-streaming": _reg("streaming", SquaredL2()),
    "entmax15-auto": _reg("auto", Tsallis(1.5)),
    "entmax13-streaming": _reg("streaming", Tsallis(1.3)),
    # Shannon with a bias (mask / locality): the fused biased-softmax Functions give way too
    "softmax-locality": lambda q, k, v, m, c: regularized_attention(q, k, v, attn_mask=m, is_causal=c,
                                                                    locality=0.3),
}


def _inputs(seed=0, b=3, h=2, n=5, d=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, generator=g) for _ in range(3))
    keys = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keys[0, ..., 3:] = False  # key padding: example 0 has 3 keys, example 2 only 1
    if b > 2:
        keys[2, ..., 1:] = False
    return q, k, v, keys


_CAUSAL = ("dnas-streaming", "sinkhorn3-materialized", "hnas-materialized", "sparsemax-streaming",
           "entmax15-auto", "softmax-locality")
CASES = ([(name, masked, False) for name in OPS for masked in (False, True)]
         + [(name, False, True) for name in _CAUSAL])


@pytest.mark.parametrize(("name", "masked", "causal"), CASES)
def test_vmap_equals_the_batched_call(name, masked, causal):
    op = OPS[name]
    q, k, v, keys = _inputs()
    m = keys if masked else None
    want = op(q, k, v, m, causal)
    got = func.vmap(lambda a, b, c, mm: op(a, b, c, mm, causal), in_dims=(0, 0, 0, 0 if masked else None))(
        q, k, v, m)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize(("name", "masked", "causal"), CASES)
def test_grad_and_per_example_grads_equal_autograd(name, masked, causal):
    """``grad`` of a loss in q, k, v equals autograd through the fast path; ``vmap(grad)`` (per-example
    gradients) equals one autograd call per example."""
    op = OPS[name]
    q, k, v, keys = _inputs(1)
    m = keys if masked else None
    target = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2))

    def loss(a, b, c, mm, t):
        return (op(a, b, c, mm, causal) - t).square().sum()

    got = func.grad(loss, argnums=(0, 1, 2))(q, k, v, m, target)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves, m, target), leaves)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **TOL)
    per = func.vmap(func.grad(loss, argnums=(0, 1, 2)), in_dims=(0, 0, 0, 0 if masked else None, 0))(
        q, k, v, m, target)
    for i in range(q.shape[0]):
        leaves = [x[i].clone().requires_grad_() for x in (q, k, v)]
        want = torch.autograd.grad(loss(*leaves, None if m is None else m[i], target[i]), leaves)
        for g_, w_ in zip(per, want):
            torch.testing.assert_close(g_[i], w_, **TOL)


@pytest.mark.parametrize("name", OPS)
def test_jacrev_equals_the_autograd_jacobian(name):
    op = OPS[name]
    q, k, v, keys = _inputs(3, b=1, h=2, n=4, d=2)
    got = func.jacrev(lambda a, b: op(a, b, v, keys, False), argnums=(0, 1))(q, k)
    want = torch.autograd.functional.jacobian(lambda a, b: op(a, b, v, keys, False), (q, k))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **TOL)


@pytest.mark.parametrize("name", OPS)
def test_jvp_equals_the_jacobian_times_the_tangent(name):
    """Forward mode (``jvp``, hence ``jacfwd`` / ``hessian``): the sparse maps' Functions have a
    ``jvp`` (their symmetric Jacobian), the rest is plain ops."""
    op = OPS[name]
    q, k, v, keys = _inputs(6, b=1, h=2, n=4, d=2)
    t = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    f = lambda a: op(a, k, v, keys, False)  # noqa: E731
    out, got = func.jvp(f, (q,), (t,))
    jac = func.jacrev(f)(q)
    torch.testing.assert_close(out, f(q), **TOL)
    torch.testing.assert_close(got, (jac * t).flatten(-q.dim()).sum(-1), **TOL)


def test_hnas_weight_gradient_under_grad_and_vmap():
    q, k, v, keys = _inputs(4)

    def loss(w):
        return hybrid_normalized_attention(q, k, v, w, attn_mask=keys).square().sum()

    w = W_HEADS.clone().requires_grad_()
    want = torch.autograd.grad(loss(w), w)[0]
    torch.testing.assert_close(func.grad(loss)(W_HEADS), want, **TOL)
    ws = torch.stack([W_HEADS, W_HEADS.flip(0)])
    torch.testing.assert_close(func.vmap(loss)(ws), torch.stack([loss(ws[0]), loss(ws[1])]), **TOL)


def test_bad_inputs_still_raise_under_transforms():
    """The value checks read under the wrappers: a weight outside [0, 1] in one vmapped example and a
    NaN query under grad are the usual ValueErrors, never a silent result."""
    q, k, v, _ = _inputs(5)
    with pytest.raises(ValueError, match=r"weight must lie in \[0, 1\]"):
        func.vmap(lambda w: hybrid_normalized_attention(q, k, v, w))(
            torch.tensor([0.5, 1.5], dtype=torch.float64))
    bad = q.clone()
    bad[1, 0, 0, 0] = float("nan")
    for op in (OPS["dnas-auto"], OPS["sparsemax-materialized"]):
        with pytest.raises(ValueError, match=r"^q contains NaN"):
            func.grad(lambda a, op=op: op(a, k, v, None, False).sum())(bad)
        with pytest.raises(ValueError, match=r"^q contains NaN"):
            func.vmap(lambda a, op=op: op(a, k, v, None, False))(bad)


@pytest.mark.parametrize("name", ["dnas-auto", "sinkhorn3-streaming", "hnas-materialized", "sparsemax-auto",
                                  "entmax15-auto"])
def test_meta_tensors_give_the_output_shape(name):
    op = OPS.get(name, _reg("auto", SquaredL2()))
    q, k, v = (torch.empty(2, 2, 6, 4, device="meta", dtype=torch.float64) for _ in range(3))
    w = W.to("meta") if name.startswith("hnas") else None
    out = (op(q, k, v, None, False) if w is None
           else hybrid_normalized_attention(q, k, v, w, impl="materialized"))
    assert out.shape == (2, 2, 6, 4) and out.is_meta


MODULES = {"dnas": {}, "sinkhorn": {}, "hnas": {"per_head": True}, "sparsemax": {}, "entmax": {}}


@pytest.mark.parametrize("name", MODULES)
def test_registry_module_per_example_gradients(name):
    """``vmap(grad(functional_call))`` — per-example parameter gradients with key padding — equals one
    autograd call per example; ``vmap`` of the forward equals the batched forward."""
    torch.manual_seed(0)
    layer = make_attention(name, 8, 2, **MODULES[name]).double()
    params = {n: p.detach() for n, p in layer.named_parameters()}
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1:] = True

    def run(p, xi, mi):
        return func.functional_call(layer, p, (xi[None],), {"key_padding_mask": mi[None]})[0][0]

    def loss(p, xi, mi):
        return run(p, xi, mi).square().sum()

    torch.testing.assert_close(func.vmap(run, in_dims=(None, 0, 0))(params, x, pad),
                               layer(x, key_padding_mask=pad)[0], **TOL)
    per = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, pad)
    for i in range(3):
        layer.zero_grad()
        layer(x[i:i + 1], key_padding_mask=pad[i:i + 1])[0].square().sum().backward()
        for n, p in layer.named_parameters():
            torch.testing.assert_close(per[n][i], p.grad, **TOL, msg=f"{name}: {n}")


def test_forward_mode_in_alpha_and_with_dual_tensors():
    """Forward mode in a tensor ``alpha`` equals ``jacrev``; ``torch.autograd.forward_ad`` dual
    tensors (outside torch.func) give ``torch.func.jvp``'s tangent (they raised before; every op:
    tests/functional/test_forward_mode.py)."""
    import torch.autograd.forward_ad as fwad

    from attnopt.functional import entmax, sparsemax

    x = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    for a in (0.6, 1.0, 1.4, 2.5):
        alpha = torch.tensor(a, dtype=torch.float64)
        got = func.jvp(lambda b: entmax(x, alpha=b), (alpha,), (torch.ones_like(alpha),))[1]
        torch.testing.assert_close(got, func.jacrev(lambda b: entmax(x, alpha=b))(alpha), **TOL)
    got = func.jvp(lambda s: entmax(s, alpha=alpha), (x,), (torch.ones_like(x),))[1]
    torch.testing.assert_close(got, torch.zeros_like(x), **TOL)  # a shift of all scores: p unchanged
    t = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(9))
    with fwad.dual_level():
        dual = fwad.unpack_dual(sparsemax(fwad.make_dual(x, t))).tangent
    torch.testing.assert_close(dual, func.jvp(sparsemax, (x,), (t,))[1], **TOL)
