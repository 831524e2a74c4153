"""The DNAS / HNAS router under ``torch.compile`` and ``torch.export`` (issue 30): K = 1 float32 CPU
calls become the one op ``attnopt::dn_fwd`` (backward ``attnopt::dn_bwd``); where the C passes
underflow, the ops recompute in the log domain inside their bodies (no ``where`` / ``cond`` in the
graph), and every other case (Sinkhorn-K, float64) keeps the reference.

Every test compiles (a few seconds each): the default run keeps the graph check of DNAS and HNAS;
``pytest -m slow tests/functional/test_dnas_compiled_ops.py`` runs the rest (about a minute).
Without the C library the ops run their log-domain fallback: the value checks hold either way;
:func:`test_the_op_ran_its_c_passes` needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attnopt
from attnopt.functional.doubly_normalized import cpu
from tests._marks import needs_native
from tests.functional._graphs import Recorder


def _qkv(b: int = 2, h: int = 3, nq: int = 5, nk: int = 6, dtype: torch.dtype = torch.float32) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, e, generator=g, dtype=dtype).requires_grad_()
            for n, e in ((nq, 4), (nk, 4), (nk, 3))]


def _masks(b: int = 2, nq: int = 5, nk: int = 6) -> dict:
    g = torch.Generator().manual_seed(1)
    key = torch.ones(b, 1, 1, nk, dtype=torch.bool)
    key[0, ..., -2:] = False
    full = 0.3 * torch.randn(1, 1, nq, nk, generator=g)
    return {"none": None, "key": key, "full": full}


def _dn(mask: torch.Tensor | None, causal: bool) -> Callable:
    return lambda q, k, v: attnopt.doubly_normalized_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                               causal="plan")


def _hn(w: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> Callable:
    return lambda q, k, v: attnopt.hybrid_normalized_attention(q, k, v, w, attn_mask=mask, is_causal=causal,
                                                               causal="plan")


def _compiled_and_reference(fn: Callable, leaves: list, rec: Recorder) -> None:
    """Compiled values and gradients (w.r.t. ``leaves``) equal the reference's (float32)."""
    q, k, v = leaves[:3]
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=rec)(q, k, v)
    with attnopt.backend("reference"):
        want = fn(q, k, v)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    go = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(got, leaves, go), torch.autograd.grad(want, leaves, go), strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("hnas", [False, True])
def test_compiled_graph_holds_the_op_and_matches_the_reference(hnas: bool) -> None:
    q, k, v = _qkv()
    w = torch.tensor([0.2, 0.5, 0.9], requires_grad=True)
    fn = _hn(w, None, False) if hnas else _dn(None, False)
    rec = Recorder()
    _compiled_and_reference(fn, [q, k, v, w] if hnas else [q, k, v], rec)
    assert rec.count("attnopt.dn_fwd") == 1 and rec.count("attnopt.dn_bwd") == 1, rec.targets


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["none", "key", "full"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hnas", [False, True])
def test_compiled_masks_and_causal(mask: str, causal: bool, hnas: bool) -> None:
    q, k, v = _qkv(nq=6, nk=6)
    m = _masks(nq=6, nk=6)[mask]
    w = torch.tensor(0.4, requires_grad=True)
    fn = _hn(w, m, causal) if hnas else _dn(m, causal)
    rec = Recorder()
    _compiled_and_reference(fn, [q, k, v, w] if hnas else [q, k, v], rec)
    assert rec.count("attnopt.dn_fwd") == 1 and rec.count("attnopt.dn_bwd") == 1


def _dominated(b: int = 1, h: int = 2, nq: int = 6, nk: int = 6, d: int = 3, dv: int = 4) -> list:
    """float32: query 2 scores ~165·scale·2 below every other query on every key (scale 1/2 and
    1 alike), so its first row sum underflows in the C passes: ``ok`` is False."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(b, h, nk, d, generator=g)
    k[..., 0] += 10.0
    q = torch.randn(b, h, nq, d, generator=g)
    q[..., 0] = 3.0
    q[..., 2, :] = 0.0
    q[..., 2, 0] = -30.0
    v = torch.randn(b, h, nk, dv, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.slow
@pytest.mark.parametrize("hnas", [False, True])
def test_underflow_fallback_under_compile_equals_the_reference(hnas: bool) -> None:
    """With autograd and without: the reference's values and gradients, finite, although the C
    passes underflowed — the ops recompute in the log domain inside their bodies, so the graph holds
    the op and no data-dependent selection (no ``where`` / ``cond``)."""
    q, k, v = _dominated()
    w = torch.tensor(0.4, requires_grad=True)
    if cpu.library(q, 1) is not None:
        det = (q.detach(), k.detach(), v.detach())
        assert not bool(torch.ops.attnopt.dn_fwd(*det, None, None, False, 1.0)[-1])

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if hnas:
            return attnopt.hybrid_normalized_attention(q, k, v, w, scale=1.0)
        return attnopt.doubly_normalized_attention(q, k, v, scale=1.0)

    rec = Recorder()
    _compiled_and_reference(fn, [q, k, v, w] if hnas else [q, k, v], rec)
    assert rec.count("attnopt.dn_fwd") == 1 and rec.count("cond") == 0, rec.targets
    torch._dynamo.reset()
    rec = Recorder()
    with torch.no_grad():
        got = torch.compile(fn, fullgraph=True, backend=rec)(q, k, v)
        with attnopt.backend("reference"):
            want = fn(q, k, v)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert rec.count("attnopt.dn_fwd") == 1 and rec.count("cond") == 0, rec.targets


class _Attn(torch.nn.Module):
    def __init__(self, hnas: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.2, 0.5, 0.9])) if hnas else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.w is None:
            return attnopt.doubly_normalized_attention(q, k, v)
        return attnopt.hybrid_normalized_attention(q, k, v, self.w)


@pytest.mark.slow
@pytest.mark.parametrize("hnas", [False, True])
def test_export_in_eval_holds_the_op(hnas: bool) -> None:
    """``torch.export`` (eval, no grad): the program holds ``attnopt.dn_fwd`` (and no ``cond``); it
    matches the reference on ordinary inputs and on a dominated row (the op's own fallback)."""
    module = _Attn(hnas).eval()
    q, k, v = (t.detach() for t in _qkv())
    with torch.no_grad():
        program = torch.export.export(module, (q, k, v))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert sum(t.startswith("attnopt.dn_fwd") for t in targets) == 1 and "cond" not in targets, targets
        dominated = [t.detach() for t in _dominated(2, 3, 5, 6, 4, 3)]
        if cpu.library(q, 1) is not None:
            assert not bool(torch.ops.attnopt.dn_fwd(*dominated, None, None, False, 0.5)[-1])
        for args in ((q, k, v), dominated):
            with attnopt.backend("reference"):
                want = module(*args)
            torch.testing.assert_close(program.module()(*args), want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_sinkhorn_k_is_the_op_under_compile() -> None:
    """Sinkhorn-K (K = 3, float32, causal and not): the graph holds ``attnopt.dn_fwd`` once (its C
    passes ``sk_fwd`` / ``sk_bwd``); values and gradients of the reference."""
    for causal in (False, True):
        q, k, v = _qkv(nq=6, nk=6)
        fn = lambda q, k, v, causal=causal: attnopt.doubly_normalized_attention(  # noqa: E731
            q, k, v, iterations=3, is_causal=causal, causal="plan")
        rec = Recorder()
        _compiled_and_reference(fn, [q, k, v], rec)
        assert rec.count("attnopt.dn_fwd") == 1, rec.targets


@pytest.mark.slow
def test_float64_keeps_the_reference_under_compile() -> None:
    q, k, v = _qkv(dtype=torch.float64)
    fn = lambda q, k, v: attnopt.doubly_normalized_attention(q, k, v, iterations=3)  # noqa: E731
    rec = Recorder()
    _compiled_and_reference(fn, [q, k, v], rec)
    assert rec.count("attnopt.") == 0, rec.targets


@pytest.mark.slow
def test_no_library_at_run_time_runs_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph traced with the op, run where the C library is off (``ATTNOPT_NATIVE=0``): the op
    returns ``ok`` False and the graph's reference answers (values and gradients)."""
    q, k, v = _qkv()
    fn = _dn(None, False)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(q, k, v)  # traced with the library as it is
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    assert not bool(torch.ops.attnopt.dn_fwd(q.detach(), k.detach(), v.detach(), None, None, False, 0.5)[-1])
    got = compiled(q, k, v)
    with attnopt.backend("reference"):
        want = fn(q, k, v)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
@needs_native
def test_the_op_ran_its_c_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled graph's op runs the C passes (``cpu.dn_forward`` / ``dn_backward``), not only the
    fallback: values from the op's own output."""
    calls: list[str] = []
    for name in ("dn_forward", "dn_backward"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    q, k, v = _qkv()
    rec = Recorder()
    _compiled_and_reference(_dn(None, False), [q, k, v], rec)
    assert calls == ["dn_forward", "dn_backward"]
