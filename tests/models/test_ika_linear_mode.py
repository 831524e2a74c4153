"""A Transformer encoder with the implicit kernels' linear mode trains with padded batches."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnopt.models import TransformerEncoder, auxiliary_loss


def _encoder(mode: str) -> TransformerEncoder:
    torch.manual_seed(0)
    return TransformerEncoder(d_model=8, num_heads=2, num_layers=2, attention="ikan", vocab_size=12,
                              num_outputs=2, dropout=0.0, pooling="mean",
                              attention_options={"mode": mode, "num_samples": 4, "p": 1.5, "seed": 0})


def test_linear_mode_encoder_trains_one_step_with_padding() -> None:
    x = torch.randint(1, 12, (4, 7), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(4, 7, dtype=torch.bool)
    pad[1, 5:] = True
    pad[3, 2:] = True
    y = torch.tensor([0, 1, 1, 0])
    lin, quad = _encoder("linear"), _encoder("quadratic").double()
    lin.load_state_dict(_encoder("linear").state_dict())
    assert all(layer.attention.mode == "linear" for layer in lin.layers)
    quad.load_state_dict(lin.state_dict())
    lin64 = _encoder("linear").double()
    lin64.load_state_dict(lin.state_dict())
    # same weights, eval: the linear mode is the quadratic mode (exact form), padding included
    torch.testing.assert_close(lin64.eval()(x, key_padding_mask=pad), quad.eval()(x, key_padding_mask=pad),
                               rtol=1e-9, atol=1e-11)
    # padded = truncated for the padded example
    torch.testing.assert_close(lin64(x, key_padding_mask=pad)[3], lin64(x[3:, :2])[0], rtol=1e-9, atol=1e-11)
    # one training step: finite loss with the KL term, every parameter gets a finite gradient, weights move
    lin.train()
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in lin.parameters()]
    loss = F.cross_entropy(lin(x, key_padding_mask=pad), y) + 1e-3 * auxiliary_loss(lin)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in lin.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    densities = lin.layers[0].attention.densities[0]
    assert any(float(p.grad.abs().sum()) > 0 for p in densities.parameters())
    opt.step()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, lin.parameters()))
