r"""The implicit spectral densities' sampler in plain autograd ops: the readable oracle (a helper of the
:mod:`.spectral` node and the :mod:`.spectral_cpu` sampler, not chosen by the router itself).

implicit-kernel-attention eq. 6–8 and the analytic KL of eq. 5, set by set, with the Gaussian
copula of MIKAN (see :mod:`.spectral` for the equations): the function that the fused node of
:mod:`.spectral` and the C sampler of :mod:`.spectral_cpu` compute, and their exact double
backward (both differentiate this under ``create_graph=True``).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["copula_factor", "sample_plain", "strictly_lower"]

_PER_SET = 8  # W_1a, b_1a, W_1b, b_1b, W_2a, b_2a, W_2b, b_2b
_LS_MIN, _LS_MAX = -10.0, 5.0


def copula_factor(raw: Tensor) -> tuple[Tensor, Tensor]:
    """``(L, L̃)`` of the Gaussian copula: ``L = tril(raw, −1) + diag(exp(diag raw))``, ``L̃`` its rows
    scaled to unit norm (:meth:`attnopt.nn.spectral.GaussianCopula.factor`)."""
    low = torch.where(strictly_lower(raw), raw, 0.0) + torch.diag(raw.diagonal().exp())
    return low, low / low.norm(dim=-1, keepdim=True)


def strictly_lower(x: Tensor) -> Tensor:
    """``i > j`` mask of a square ``x``. (Not ``torch.tril``: on CPU it enters the thread pool even
    for an 8 × 8 matrix, measured 10–12 ms a call with 2 threads on the loaded 2-core machine
    against 2 µs for ``where``; its backward is another ``tril``.)"""
    i = torch.arange(x.shape[-1], device=x.device)
    return i.unsqueeze(-1) > i


def sample_plain(
    h: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...], params: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """The node's function in plain autograd ops (eq. 6–8, the copula and the KL, set by set)."""
    d, half = h.shape[-1], noise.shape[-2]
    fac = None
    if raw is not None:
        fac = copula_factor(raw)[1]
        noise = torch.einsum("mh,...hnd->...mnd", fac.to(noise.dtype), noise)
    sets, kl = [], h.new_zeros(h.shape[:-2])
    for s, scale in enumerate(scales):
        w1a, b1a, w1b, b1b, w2a, b2a, w2b, b2b = params[s * _PER_SET : (s + 1) * _PER_SET]
        o1 = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(h, w1a, b1a)), w1b, b1b)
        mu, ls = o1[..., :d], o1[..., d:].clamp(_LS_MIN, _LS_MAX)
        z = mu.unsqueeze(-2) + ls.exp().unsqueeze(-2) * noise[s]
        a = z.abs()
        t2 = torch.tanh(torch.nn.functional.linear(a, w2a, b2a))
        hp = torch.sign(z) * (a * scale + torch.nn.functional.linear(t2, w2b, b2b))
        sets += [hp, -hp]
        kl = kl + 0.5 * half * (torch.exp(2 * ls) + mu * mu - 1.0 - 2 * ls).sum((-2, -1))
    if fac is not None:
        kl = kl - (0.5 * d * half * len(scales)) * (2 * fac.diagonal().log().sum().to(kl.dtype))
    return torch.cat(sets, dim=-2), kl
