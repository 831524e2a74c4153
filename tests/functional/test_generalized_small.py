"""generalized_attention at short sequences: SDPA itself below SDPA_BELOW, plain SDPA for a
bias too narrow to make subnormal weights, cached and post-hoc checks of log_preference."""
from __future__ import annotations

import pytest
import torch

from attnopt.functional import dispatch, generalized
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized import check_log_preference_values, generalized_attention
from attnopt.nn.preference import ALiBiPreference, T5RelativePreference
from tests.reference.generalized import generalized_attention_ref


def _qkv(b, h, n, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _check_against_reference(out, q, k, v, bias, is_causal=False):
    ref = generalized_attention_ref(q, k, v, attn_mask=bias, is_causal=is_causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    leaves = tuple(t for t in (q, k, v, bias) if t.requires_grad)
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("b", [1, 2])
def test_learned_bias_goes_to_sdpa_below_the_threshold_and_to_the_node_above(monkeypatch, b):
    q, k, v = _qkv(b, 2, 6)
    t5 = T5RelativePreference(2, num_buckets=8, max_distance=16).double()
    size = b * 2 * 6 * 6
    for limit, expected in ((size, "streaming"), (size - 1, "materialized")):
        monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below", limit)
        monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below_learned_native", limit)
        # a copy: the C node reads a T5 bias through its offsets (no gradient for the tensor itself;
        # tests/functional/test_generalized_native.py checks that route via the bucket table)
        bias = t5(6, 6).clone()
        out = generalized_attention(q, k, v, log_preference=bias, is_causal=True)
        assert dispatch.last_dispatch["generalized"] == expected
        _check_against_reference(out, q, k, v, bias, is_causal=True)  # (1, H, …) bias, B = 1 or 2


def test_narrow_constant_bias_calls_sdpa_itself_and_a_wide_one_the_flushing_kernel(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below", 0)
    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below_learned_native", 0)
    calls: list[float] = []
    real = generalized.biased_flash_attention

    def spy(q, k, v, bias, scale):  # type: ignore[no-untyped-def]
        calls.append(float(bias.amin()))
        return real(q, k, v, bias, scale)

    monkeypatch.setattr(generalized, "biased_flash_attention", spy)
    q, k, v = _qkv(1, 2, 9)
    narrow = ALiBiPreference(2, slopes=torch.tensor([1.0, 0.5], dtype=torch.float64))(9, 9)  # spread 8
    wide = ALiBiPreference(2, slopes=torch.tensor([20.0, 0.5], dtype=torch.float64))(9, 9)  # spread 160
    for bias, flushed in ((narrow, False), (wide, True)):
        calls.clear()
        out = generalized_attention(q, k, v, log_preference=bias, impl="streaming")
        assert dispatch.last_dispatch["generalized"] == "streaming"
        assert bool(calls) == flushed
        _check_against_reference(out, q, k, v, bias)


def test_log_preference_range_is_cached_per_version_and_rechecked_after_an_inplace_change():
    bias = torch.tensor([[0.0, -3.0], [-1.0, 2.0]])
    assert check_log_preference_values(bias) == (-3.0, 2.0)
    assert bias._attnopt_range[0] == bias._version  # type: ignore[attr-defined]
    bias[0, 0] = float("nan")  # bumps the version: read again
    with pytest.raises(ValueError, match="log_preference"):
        check_log_preference_values(bias)
    base = torch.zeros(2, 2)
    view = base[0]
    assert check_log_preference_values(view) == (0.0, 0.0)
    base[0, 1] = float("inf")  # a change through the base shares the version counter
    with pytest.raises(ValueError, match="log_preference"):
        check_log_preference_values(view)


@pytest.mark.parametrize("impl", ["auto", "materialized", "streaming"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_posinf_in_a_learned_bias_is_rejected_on_every_path(native_or_torch, impl, bad):
    q, k, v = _qkv(1, 2, 5)
    bias = torch.zeros(1, 2, 5, 5, dtype=torch.float64)
    bias[0, 1, 3, 2] = bad
    with pytest.raises(ValueError, match="log_preference"):
        generalized_attention(q, k, v, log_preference=bias.requires_grad_(), impl=impl)


def test_rows_with_no_key_are_zero_in_the_node_after_its_posthoc_check(native_or_torch):
    q, k, v = _qkv(2, 2, 5, seed=3)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    bias[..., 2, :] = float("-inf")
    bias.requires_grad_()
    out = generalized_attention(q, k, v, log_preference=bias, impl="materialized")
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    _check_against_reference(out, q, k, v, bias)
