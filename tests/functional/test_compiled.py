"""``attnopt.functional.compiled``: torch.compile where inductor can build, eager otherwise."""
from __future__ import annotations

import warnings

import pytest
import torch

import attnopt
from attnopt.functional import _compiled as compiled_mod
from attnopt.functional._compiled import compiled, cpu_compiler, inductor_available


def _attn(q, k, v):
    return attnopt.generalized_attention(q, k, v, log_preference=attnopt.nn.ALiBiPreference(2)(5, 5))


def test_no_cpu_compiler_falls_back_to_eager_silently(monkeypatch):
    monkeypatch.setattr(compiled_mod.shutil, "which", lambda name: None)
    assert cpu_compiler() is None and not inductor_available("cpu")
    layer = attnopt.nn.make_attention("alibi", 8, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled(_attn) is _attn
        assert compiled(layer, mode="max-autotune") is layer
        assert compiled(_attn, device="cpu", dynamic=False) is _attn


def test_detection_reads_inductor_cxx_setting(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("no-such-compiler-xyz",))
    assert cpu_compiler() is None
    monkeypatch.setattr(config.cpp, "cxx", (None, "sh"))  # any executable on PATH counts as found
    assert cpu_compiler() is not None and inductor_available("cpu")


@pytest.mark.slow
def test_backend_without_compiler_still_compiles_and_matches_eager(monkeypatch):
    monkeypatch.setattr(compiled_mod.shutil, "which", lambda name: None)
    fn = compiled(_attn, backend="aot_eager")
    assert fn is not _attn
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(fn(q, k, v), _attn(q, k, v), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.skipif(cpu_compiler() is None, reason="no C++ compiler for CPU inductor")
def test_inductor_path_matches_eager_values_and_gradients():
    fn = compiled(_attn)
    assert fn is not _attn
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, ref = fn(q, k, v), _attn(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
