"""Numerically safe softmax pieces shared by the functional ops (internal)."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["safe_softmax", "safe_logsumexp"]


def safe_logsumexp(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """``logsumexp`` that returns ``-inf`` (not NaN) for an all ``-inf`` or empty slice, with finite grads."""
    if x.shape[dim] == 0:  # amax refuses an empty reduction; the sum over nothing is 0
        out = x.sum(dim=dim, keepdim=True) + float("-inf")
        return out if keepdim else out.squeeze(dim)
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim=dim, keepdim=True)
    nonempty = s > 0
    out = torch.where(nonempty, torch.log(torch.where(nonempty, s, torch.ones_like(s))) + m, float("-inf"))
    return out if keepdim else out.squeeze(dim)


def safe_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim``; a slice that is entirely ``-inf`` gives zeros (finite gradient).

    Half precision is computed in float32 and cast back; an empty ``dim`` gives an empty result.
    """
    if x.shape[dim] == 0:
        return x * 0
    orig = x.dtype
    if orig in (torch.float16, torch.bfloat16):
        x = x.float()
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    out = e / torch.where(s > 0, s, torch.ones_like(s))
    return out.to(orig)
