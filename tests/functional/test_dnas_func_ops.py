"""DNAS / HNAS under ``torch.func`` (issue 30 item 2): with ``vmap`` and one ``grad`` / ``vjp`` /
``jacrev`` level, K = 1 float32 CPU calls run the C passes as the ops ``attnopt::dn_fwd`` /
``dn_bwd`` — one call each for a whole ``vmap`` batch, through the ops' batching rules — and give
the reference's values and gradients; other transforms (``jacfwd``, nested ``grad``) keep the
reference. Without the C library the ops run their log-domain fallback: the value checks hold
either way; the call counts need the library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch.autograd import forward_ad

import attnopt
from attnopt.functional import dispatch
from attnopt.functional._func_ops import transforms_supported
from attnopt.functional.doubly_normalized import cpu
from tests._marks import needs_native


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """How often the C forward and backward bodies ran (the ops' bodies call these)."""
    counts = {"fwd": 0, "bwd": 0}
    fwd, bwd = cpu.dn_forward, cpu.dn_backward

    def counted_fwd(*a: object) -> object:
        counts["fwd"] += 1
        return fwd(*a)

    def counted_bwd(*a: object) -> object:
        counts["bwd"] += 1
        return bwd(*a)

    monkeypatch.setattr(cpu, "dn_forward", counted_fwd)
    monkeypatch.setattr(cpu, "dn_backward", counted_bwd)
    yield counts


def _qkv(b: int = 4, h: int = 3, nq: int = 5, nk: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, e, generator=g) for n, e in ((nq, 4), (nk, 4), (nk, 3))]


def _reference(fn: Callable, *args: torch.Tensor) -> object:
    with attnopt.backend("reference"):
        return fn(*args)


def _close(a: object, b: object, tol: float = 2e-5) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize(("mask_kind", "causal"), [("none", False), ("key", False), ("full", True)])
def test_vmap_grad_per_example_gradients(mask_kind: str, causal: bool, calls: dict) -> None:
    """Per-example gradients (``vmap(grad(f))``) of DNAS: the reference's, from one C forward and
    one C backward for the whole batch of examples."""
    q, k, v = _qkv()
    mask = {"none": None, "key": torch.tensor([True] * 4 + [False] * 2),
            "full": 0.3 * torch.randn(5, 6, generator=torch.Generator().manual_seed(1))}[mask_kind]

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = attnopt.doubly_normalized_attention(q, k, v, attn_mask=mask, is_causal=causal, causal="plan")
        return out.square().sum()

    per_example = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))
    got = per_example(q, k, v)
    assert dispatch.last_dispatch["doubly_normalized"] == "materialized"
    want = _reference(per_example, q, k, v)
    for a, b in zip(got, want, strict=True):  # type: ignore[call-overload]
        _close(a, b)
    if cpu.library(q, 1) is not None:
        assert calls == {"fwd": 1, "bwd": 1}


def test_vmap_with_shared_arguments_and_underflow_fallback() -> None:
    """``vmap`` over ``q`` only (``k``, ``v``, the mask shared): the batching rule broadcasts them;
    an example whose row normalizer underflows in the C passes gets the log-domain value."""
    q, k, v = _qkv(b=1)
    q = q.expand(3, *q.shape).clone()
    q[1, ..., 2, :] = 0.0  # example 1: query 2 dominated on every key (first row sum underflows)
    q[1, ..., 2, 0] = -3000.0
    mask = torch.zeros(5, 6)
    mask[:, -1] = float("-inf")

    def fn(q: torch.Tensor) -> torch.Tensor:
        return attnopt.doubly_normalized_attention(q, k, v, attn_mask=mask)

    got = torch.func.vmap(fn)(q)
    want = _reference(torch.func.vmap(fn), q)
    assert torch.isfinite(got).all()
    _close(got, want)


def test_jacrev_of_the_hnas_weight(calls: dict) -> None:
    """``jacrev`` (a ``vmap`` over ``vjp``) of HNAS in its per-head weight: the reference's."""
    q, k, v = _qkv()
    w = torch.tensor([0.2, 0.5, 0.9])

    def fn(w: torch.Tensor) -> torch.Tensor:
        return attnopt.hybrid_normalized_attention(q, k, v, w).sum((0, 2, 3))

    _close(torch.func.jacrev(fn)(w), _reference(torch.func.jacrev(fn), w))
    if cpu.library(q, 1) is not None:
        assert calls == {"fwd": 1, "bwd": 1}


def test_other_transforms_keep_the_reference(calls: dict) -> None:
    """``jacfwd`` and a second ``grad`` run the plain reference (exact second derivatives)."""
    q, k, v = _qkv(b=1)

    def f(q: torch.Tensor) -> torch.Tensor:
        return attnopt.doubly_normalized_attention(q, k, v).square().sum()

    hess_vec = torch.func.grad(lambda q: torch.func.grad(f)(q).sum())
    _close(hess_vec(q), _reference(hess_vec, q), 1e-4)
    jac = torch.func.jacfwd(lambda q: attnopt.doubly_normalized_attention(q, k, v)[0, 0, 0])
    _close(jac(q), _reference(jac, q))
    assert calls == {"fwd": 0, "bwd": 0}


def test_autograd_around_a_transform_keeps_the_reference(calls: dict) -> None:
    """Ordinary autograd around ``torch.func.grad`` (``q`` requires grad): the reference runs, so
    the second derivative (and a loss that mixes it with other terms) is exact, not dropped."""
    q, k, v = _qkv(b=1)
    q.requires_grad_()

    def grad_then_sum(q: torch.Tensor) -> torch.Tensor:
        g = torch.func.grad(lambda q: attnopt.doubly_normalized_attention(q, k, v).square().sum())(q)
        return g.square().sum() + q.sum()

    got = torch.autograd.grad(grad_then_sum(q), q)[0]
    with attnopt.backend("reference"):
        want = torch.autograd.grad(grad_then_sum(q), q)[0]
    _close(got, want, 1e-4)
    assert calls == {"fwd": 0, "bwd": 0}


def test_transforms_supported() -> None:
    """The levels the op path admits: ``vmap`` and at most one ``grad``; no ``jvp``, no dual level,
    no ordinary autograd tracking the inputs."""
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(transforms_supported())
        return x.sum()

    x = torch.ones(2, 3)
    probe(x)
    torch.func.vmap(probe)(x)
    torch.func.grad(probe)(x)
    torch.func.vmap(torch.func.grad(probe))(x)
    torch.func.grad(lambda x: torch.func.grad(probe)(x).sum())(x)
    torch.func.jvp(probe, (x,), (x,))
    with forward_ad.dual_level():
        probe(forward_ad.make_dual(x, x))
    assert seen == [True, True, True, True, False, False, False]
    tracked = torch.ones(2, requires_grad=True)
    assert transforms_supported(None, x)
    assert not transforms_supported(tracked)
    inside: list[bool] = []
    torch.func.grad(lambda y: (inside.append(transforms_supported(y)), y.sum())[1])(tracked * 1)
    assert inside == [False]


@needs_native
def test_ops_opcheck_with_batching_rules() -> None:
    """``torch.library.opcheck`` of the ops (schema, fake, autograd registration) still passes with
    the batching rules registered, and ``vmap`` of the op itself equals a loop over examples."""
    q, k, v = _qkv()
    qs = torch.stack([q, q + 0.1])
    torch.library.opcheck(torch.ops.attnopt.dn_fwd.default, (q, k, v, None, None, False, 0.5),
                          test_utils=("test_schema", "test_faketensor"))
    got = torch.func.vmap(lambda q: torch.ops.attnopt.dn_fwd(q, k, v, None, None, False, 0.5)[0])(qs)
    want = torch.stack([torch.ops.attnopt.dn_fwd(x, k, v, None, None, False, 0.5)[0] for x in qs])
    _close(got, want)


def test_sinkhorn_k_vmap_grad(calls: dict) -> None:
    """Sinkhorn-K (K = 3) per-example gradients: the reference's, one C call each way."""
    q, k, v = _qkv()

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnopt.doubly_normalized_attention(q, k, v, iterations=3, is_causal=True,
                                                   causal="plan").square().sum()

    per_example = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))
    for a, b in zip(per_example(q, k, v), _reference(per_example, q, k, v), strict=True):  # type: ignore[call-overload]
        _close(a, b)
    if cpu.library(q, 3) is not None:
        assert calls == {"fwd": 1, "bwd": 1}
