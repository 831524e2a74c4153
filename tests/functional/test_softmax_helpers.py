"""The shared safe softmax / log-sum-exp helpers: all -inf slices give finite results and gradients."""
import torch

from attnopt.functional._softmax import safe_logsumexp, safe_softmax


def test_safe_logsumexp_matches_torch_and_handles_empty_slices():
    x = torch.randn(3, 5, dtype=torch.float64)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    x.requires_grad_(True)
    out = safe_logsumexp(x, dim=-1)
    torch.testing.assert_close(out[[0, 2]], torch.logsumexp(x.detach(), -1)[[0, 2]])
    assert out[1] == float("-inf")
    out[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()
    assert torch.autograd.gradcheck(lambda t: safe_logsumexp(t, dim=0), torch.randn(4, 3, dtype=torch.float64,
                                                                                        requires_grad=True))


def test_safe_softmax_zero_rows_and_half_precision():
    x = torch.randn(4, 6, dtype=torch.float64)
    x[0] = float("-inf")
    x.requires_grad_(True)
    w = safe_softmax(x, dim=-1)
    assert (w[0] == 0).all()
    torch.testing.assert_close(w[1:], torch.softmax(x.detach()[1:], -1))
    w.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    h = safe_softmax((x.detach() * 1000).half(), dim=-1)
    assert h.dtype == torch.float16 and torch.isfinite(h).all()
