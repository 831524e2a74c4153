"""The registry's ``mode`` option: the implicit kernels' exact linear-time form behind every IKA name."""
from __future__ import annotations

import pytest
import torch

from attnopt.nn import make_attention

LINEAR_NAMES = ["ika-s", "ika-ns", "ikan", "ikan-direct", "mikan", "linear"]


def _twins(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    opts = {} if name == "linear" else {"num_samples": 4, "seed": 0}
    torch.manual_seed(0)
    quad = make_attention(name, 8, 2, **opts).double()
    with torch.no_grad():  # move the zero-initialized density layers off zero so every path matters
        for pname, prm in quad.named_parameters():
            if "nn1.2" in pname or "nn2.2" in pname or "copula" in pname:
                prm.normal_(0, 0.3)
    lin = make_attention(name, 8, 2, mode="linear", **opts).double()
    lin.load_state_dict(quad.state_dict())
    assert lin.mode == "linear" and quad.mode == "quadratic"
    return quad.eval(), lin.eval()


@pytest.mark.parametrize("name", LINEAR_NAMES)
def test_linear_mode_equals_quadratic_under_model_padding(name: str) -> None:
    """The models' mask (key ∪ query padding, boolean, True = not allowed): values and gradients."""
    quad, lin = _twins(name)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    mask = pad[:, None, None, :] | pad[:, None, :, None]
    xs = [x.clone().requires_grad_() for _ in range(2)]
    out_q, out_l = quad(xs[0], attn_mask=mask)[0], lin(xs[1], attn_mask=mask)[0]
    torch.testing.assert_close(out_l, out_q, rtol=1e-9, atol=1e-11)
    go = torch.randn_like(out_q)
    out_q.backward(go)
    out_l.backward(go)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-8, atol=1e-10)
    for (n, a), b in zip(quad.named_parameters(), lin.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-8, atol=1e-10, msg=n)


def test_mode_option_is_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        make_attention("ikan", 8, 2, mode="fast")
    with pytest.raises(ValueError, match="no option 'mode'"):
        make_attention("rbf-only", 8, 2, mode="linear")  # the RBF kernel has no finite feature map
    lin = make_attention("mikan", 8, 2, mode="linear", num_samples=4)
    causal_with_padding = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="needs a key mask"):
        lin(torch.randn(1, 5, 8), attn_mask=causal_with_padding)
    out, _ = lin(torch.randn(1, 5, 8), is_causal=True)  # causal itself is prefix sums
    assert torch.isfinite(out).all()
