"""Arms and attention probes shared by the implicit-kernel tasks."""

import math

import pytest
import torch

from attnopt.experiments import _ika
from attnopt.nn import ImplicitKernelAttention


def test_arm_options_map_the_papers_rows_to_registry_names():
    assert _ika.arm_options("transformer", p=1.5, num_samples=8) == {
        "attention": "softmax",
        "attention_options": {},
    }
    assert _ika.arm_options("expsin", p=1.5, num_samples=8)["attention"] == "expsin"
    ika_s = _ika.arm_options("ika-s", p=1.5, num_samples=8)["attention_options"]
    assert "p" not in ika_s and ika_s["num_samples"] == 8  # IKA rows keep the L2 magnitude
    mikan = _ika.arm_options("mikan-p0.25", p=1.5, num_samples=4, mode="linear")
    assert mikan == {
        "attention": "mikan",
        "attention_options": {"num_samples": 4, "p": 0.25, "mode": "linear", "hidden": 32},
    }
    assert "hidden" not in _ika.arm_options("ikan-direct", p=2.0, num_samples=4)["attention_options"]
    with pytest.raises(ValueError, match="unknown arm"):
        _ika.arm_options("performer", p=1.0, num_samples=4)


def test_probes_read_weights_and_decomposition_without_changing_the_model():
    torch.manual_seed(0)
    layer = ImplicitKernelAttention(16, 2, variant="ikan", num_samples=4, p=1.5, seed=0)
    model = torch.nn.Sequential(layer)
    model.train()
    x = torch.randn(3, 5, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, -2:] = True
    calls = _ika.capture_layer_inputs(model, [layer], lambda: layer(x, key_padding_mask=pad))
    assert model.training  # mode restored
    w = _ika.layer_weights(layer, calls[0])
    assert w.shape == (3, 2, 5, 5) and torch.allclose(w.sum(-1), torch.ones(3, 2, 5))
    assert torch.all(w[0, :, :, -2:] == 0)  # padding keys get no weight
    sim, mag = _ika.similarity_magnitude(layer, calls[0])
    assert 0 < sim <= 1 + 1e-5 and math.isfinite(mag)
    # the maximum similarity is that of the kernel the layer uses (f² + ε), by hand:
    q = layer.split_heads(layer.q_proj(x)).detach()
    k = layer.split_heads(layer.k_proj(x)).detach()
    layer.eval()
    with torch.no_grad():
        s = layer.kernel_for(k)(q, k).square() + layer.eps
    s = s.masked_fill(pad[:, None, None, :], 0.0)
    assert sim == pytest.approx(float(s.amax(-1).mean()), rel=1e-5)


def test_head_std_and_sparsity_stats():
    same = torch.tensor([[0.2, 0.8], [0.2, 0.8]])  # (H=2, E=2): identical heads
    assert _ika.head_std(same) == 0.0
    diff = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert _ika.head_std(diff) == pytest.approx(0.5)
    st = _ika.sparsity_stats(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    assert st["mean_max_weight"] == pytest.approx(0.75) and st["share_above_0.99"] == pytest.approx(0.25)
    assert st["share_below_0.01"] == pytest.approx(0.25)


def test_similarity_magnitude_reads_boolean_attn_masks_like_key_padding():
    torch.manual_seed(1)
    layer = ImplicitKernelAttention(16, 2, variant="mikan", num_samples=4, p=1.0, seed=0)
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, -3:] = True
    by_pad = _ika.similarity_magnitude(layer, ((x,), {"key_padding_mask": pad}))
    mask = pad[:, None, None, :] | pad[:, None, :, None]  # padding keys and padding query rows
    by_mask = _ika.similarity_magnitude(layer, ((x, x, x), {"attn_mask": mask}))
    unmasked = _ika.similarity_magnitude(layer, ((x,), {}))
    assert by_pad[0] == pytest.approx(by_mask[0], rel=0.2) and by_mask != unmasked
    causal = _ika.similarity_magnitude(layer, ((x,), {"is_causal": True}))
    assert causal[0] <= unmasked[0] + 1e-6  # fewer admissible keys: a smaller row maximum
