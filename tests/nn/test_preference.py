"""Preference modules: T5 buckets (vs Hugging Face's T5), ALiBi slopes, key-only preferences."""
import pytest
import torch

from attnopt.functional._thresholds import THRESHOLDS
from attnopt.nn import ALiBiPreference, KeyPreference, T5RelativePreference
from attnopt.nn.preference import alibi_slopes, relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)
    ours = relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)
    theirs = t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, theirs)


def test_t5_preference_shape_and_lookup():
    pref = T5RelativePreference(3, num_buckets=8, max_distance=16)
    out = pref(4, 6)
    assert out.shape == (1, 3, 4, 6)
    buckets = relative_position_bucket(torch.arange(6)[None] - torch.arange(4)[:, None], num_buckets=8,
                                       max_distance=16)
    torch.testing.assert_close(out[0, 2], pref.relative_attention_bias.weight[buckets, 2])
    # equal relative distances share one value (Toeplitz)
    assert torch.equal(out[0, :, 1, 2], out[0, :, 2, 3])


def test_causal_t5_has_one_bucket_for_future():
    pref = T5RelativePreference(2, bidirectional=False, num_buckets=8, max_distance=16)
    out = pref(5, 5)
    assert torch.equal(out[0, :, 0, 1], out[0, :, 0, 4])  # future positions share bucket 0


def test_alibi_slopes_standard_values():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)],
                                                              dtype=torch.float64))
    s6 = alibi_slopes(6)
    assert s6.shape == (6,) and (s6 > 0).all() and len(set(s6.tolist())) == 6


def test_alibi_values():
    pref = ALiBiPreference(2, slopes=torch.tensor([0.5, 2.0]))
    out = pref(3, 4)
    expected = -torch.tensor([0.5, 2.0]).view(2, 1, 1) * (torch.arange(3)[:, None] - torch.arange(4)).abs()
    torch.testing.assert_close(out[0], expected.float())


def test_key_preference_is_key_only_and_trainable():
    kp = KeyPreference(8, 2, hidden_dim=5)
    key = torch.randn(3, 7, 8)
    out = kp(key)
    assert out.shape == (3, 2, 1, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in kp.parameters())


def test_bad_arguments():
    with pytest.raises(ValueError, match="slopes"):
        ALiBiPreference(3, slopes=torch.ones(2))
    with pytest.raises(ValueError, match="slopes"):
        ALiBiPreference(2, slopes=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="num_heads"):
        T5RelativePreference(0)
    with pytest.raises(ValueError, match="key"):
        KeyPreference(4, 2)(torch.randn(4, 4))


@pytest.mark.parametrize("native", ["1", "0"])  # the bias laid out in C, or by PyTorch ops
@pytest.mark.parametrize("gather_limit", [0, 1 << 20])  # the strided Toeplitz route and the gather route
@pytest.mark.parametrize("shape", [(1, 1), (4, 9), (9, 4), (33, 33)])
def test_t5_bias_and_bucket_gradient_match_elementwise_lookup(monkeypatch, gather_limit, shape, native):
    from attnopt.nn import preference as pref

    monkeypatch.setenv("ATTNOPT_NATIVE", native)
    monkeypatch.setattr(THRESHOLDS, "t5_gather_limit", gather_limit)
    nq, nk = shape
    t5 = pref.T5RelativePreference(3, num_buckets=8, max_distance=16).double()
    rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]
    buckets = pref.relative_position_bucket(rel, num_buckets=8, max_distance=16)
    w = t5.relative_attention_bias.weight
    ref = w[buckets].permute(2, 0, 1).unsqueeze(0)  # (1, H, Nq, Nk), elementwise embedding lookup
    out = t5(nq, nk)
    assert out.is_contiguous() and torch.equal(out, ref)
    assert (t5._buckets(nq, nk, w.device)[1] is None) == (nq * nk > gather_limit)
    go = torch.randn(2, 3, nq, nk, dtype=torch.float64)  # a batch of 2 broadcast over the bias
    (grad,) = torch.autograd.grad(out.expand(2, -1, -1, -1), w, go)
    (grad_ref,) = torch.autograd.grad(ref.expand(2, -1, -1, -1), w, go)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    cached = t5._buckets(nq, nk, w.device)
    assert torch.autograd.gradcheck(
        lambda w_: pref._T5Bias.apply(w_, cached[0], cached[1], nq, nk),
        (w.detach().clone().requires_grad_(),))
