"""Registry modules under ``torch.func``: vmap = the batched call, grad / vmap(grad) / jacrev = autograd.

Per-example gradients (``vmap(grad(f))`` over ``functional_call``) are the use case: the custom
autograd nodes, the C paths and the data-dependent checks must step aside for the wrapped tensors
(or batch themselves, as MEM's Newton solve does) and give the same numbers as a plain call.
The doubly-normalized and sparse mechanisms are not covered here.
"""
from __future__ import annotations

import pytest
import torch
from torch import func

from attnopt import _native
from attnopt.functional import dispatch
from attnopt.nn import make_attention

# float64, tight: the same function by other ops (plain vs fused/C), rounding only
# PyTorch warns where it batches an op by a loop (no batching rule): correct, only slower
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
TOL = {"rtol": 1e-9, "atol": 1e-11}
CASES = [
    ("t5", {}), ("mem", {}), ("linear", {}), ("linear", {"mode": "linear"}),
    ("ika-s", {}), ("ika-ns", {}), ("ikan", {"p": 1.5}), ("ikan", {"mode": "linear"}), ("mikan", {}),
    ("softmax", {}), ("alibi", {}), ("rbf-only", {}), ("expsin", {}), ("ikan-direct", {"p": 1.5}),
]
_IKA = ("ika-s", "ika-ns", "ikan", "ikan-direct", "mikan")


def _module(name: str, opts: dict, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in _IKA:
        opts = {"seed": 0, **opts}
    m = make_attention(name, 8, 2, **opts).to(dtype).eval()
    with torch.no_grad():  # off the initialization (zero last layers, identity copula, ...)
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, dtype=dtype, generator=g)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True  # example 1 has two padded keys
    return x, pad


def _loss(m: torch.nn.Module, params: dict, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    out = func.functional_call(m, params, (x,), {"key_padding_mask": pad})[0]
    return out.square().sum() + (m.kl() if hasattr(m, "kl") else 0.0)


def _autograd(m: torch.nn.Module, x: torch.Tensor, pad: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(m.named_parameters())
    m.zero_grad()
    _loss(m, params, x, pad).backward()
    return {k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in params.items()}


@pytest.mark.parametrize(("name", "opts"), CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_vmap_grad_per_example_and_jacrev_match_the_plain_calls(name, opts):
    m = _module(name, opts)
    x, pad = _inputs()
    batched = m(x, key_padding_mask=pad)[0]
    one = func.vmap(lambda a, b: m(a[None], key_padding_mask=b[None])[0][0])(x, pad)
    torch.testing.assert_close(one, batched, **TOL)

    params = {k: p.detach() for k, p in m.named_parameters()}
    got = func.grad(lambda p: _loss(m, p, x, pad))(params)
    want = _autograd(m, x, pad)
    for k in params:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)

    one_loss = lambda p, a, b: _loss(m, p, a[None], b[None])  # noqa: E731
    per = func.vmap(func.grad(one_loss), in_dims=(None, 0, 0))(params, x, pad)
    for i in range(x.shape[0]):
        want = _autograd(m, x[i : i + 1], pad[i : i + 1])
        for k in params:
            torch.testing.assert_close(per[k][i], want[k], **TOL, msg=f"{k}, example {i}")

    small = x[:1, :3]
    jac = func.jacrev(lambda a: m(a)[0])(small)
    ref = torch.autograd.functional.jacobian(lambda a: m(a)[0], small)
    torch.testing.assert_close(jac, ref, **TOL)


@pytest.mark.parametrize("name", ["ika-s", "mikan"])
def test_ika_float32_and_partial_parameters_take_the_plain_ops(name):
    """float32 (the C sampler's and the fused Fourier node's dtype) and a gradient for the density
    networks alone (projections left plain: only the spectral points are wrapped)."""
    m = _module(name, {}, torch.float32)
    x, pad = _inputs(torch.float32)
    ref = m(x)[0]  # float32 C paths vs plain ops: 5e-5 of the largest entry (as test_spectral_native)
    got = func.vmap(lambda a: m(a[None])[0][0])(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5 * ref.abs().max().item())
    sub = {k: p.detach() for k, p in m.named_parameters() if k.startswith("densities")}
    got = func.grad(lambda p: func.functional_call(m, p, (x,), strict=False)[0].square().sum())(sub)
    m.zero_grad()
    m(x)[0].square().sum().backward()
    params = dict(m.named_parameters())
    for k in sub:
        want = params[k].grad
        torch.testing.assert_close(got[k], want, rtol=0, atol=5e-5 * want.abs().max().item(), msg=k)


@pytest.mark.parametrize("name", ["ikan", "mikan"])
def test_ika_training_noise_under_vmap_follows_its_randomness_flag(name):
    """Training draws noise inside the call: vmap's default randomness="error" raises naming the
    module; "same" gives every example the draw a plain one-example call makes from the same
    generator state; "different" draws per example (the batched call's distribution, not its numbers)."""
    m = _module(name, {}).train()
    x, _ = _inputs()
    one = lambda a: m(a[None])[0][0]  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"ImplicitKernelAttention\('{name}'\).*randomness='different'"):
        func.vmap(one)(x)
    gen = m._generator
    state = gen.get_state()
    same = func.vmap(one, randomness="same")(x)
    for i in range(x.shape[0]):
        gen.set_state(state)
        torch.testing.assert_close(same[i], m(x[i : i + 1])[0][0], **TOL)
    gen.set_state(state)
    diff = func.vmap(one, randomness="different")(x)
    assert diff.shape == x.shape and torch.isfinite(diff).all()
    assert not torch.allclose(diff, same)  # not every example took the one shared draw


@pytest.mark.parametrize("name", ["t5", "alibi"])
def test_a_transform_leaves_no_wrapped_tensor_in_the_bias_caches(name):
    """vmap(grad) makes new tensors wrapped: the bucket / bias caches are not filled there, and the
    plain call afterwards still takes the whole-call C path (float32)."""
    m = _module(name, {}, torch.float32)
    x, _ = _inputs(torch.float32)
    params = {k: p.detach() for k, p in m.named_parameters()}
    loss = lambda p, a: func.functional_call(m, p, (a[None],))[0].sum()  # noqa: E731
    func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)
    pref = m.preference
    for cached in pref.__dict__.get("_bucket_cache", {}).values():
        assert _native.has_storage(cached[0])
    for cached in pref.__dict__.get("_bias_cache", {}).values():
        assert _native.has_storage(cached[1])
    m(x)[0].sum().backward()  # (raised "Cannot access data pointer" when a wrapped bucket was cached)
    if _native.enabled() and _native.blas() is not None:
        assert dispatch.last_dispatch["generalized_kernel"] == "fused"


def test_mem_nested_grad_is_refused_but_per_example_grad_is_first_order():
    """double_backward counts differentiating transforms: vmap(grad) is first order (allowed),
    grad(grad) differentiates MEM's implicit backward again (refused, as with create_graph)."""
    from attnopt.dual import mem_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 3, 4, dtype=torch.float64, generator=g) for _ in range(3))
    f = lambda a: mem_attention(a, k, v).square().sum()  # noqa: E731
    func.vmap(func.grad(lambda a: f(a[None])))(q)
    with pytest.raises(RuntimeError, match="mem_attention / mem_weights: double backward"):
        func.grad(lambda a: func.grad(f)(a).sum())(q)
