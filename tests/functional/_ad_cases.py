"""Functional ops and registry modules for the autodiff checks against central differences
(``test_outer_autograd_of_func_grad.py``, ``test_forward_mode.py``): float64, tiny sizes."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import attnopt.functional as AF
from attnopt.kernels import RBF, NonStationaryFourier, RandomFourier
from attnopt.nn import make_attention
from attnopt.nn.registry import attention_names

D = torch.float64
Q = (2, 2, 5, 4)
_RFF = RandomFourier(torch.randn(8, 4, dtype=D, generator=torch.Generator().manual_seed(3)))
_NSF = NonStationaryFourier(*torch.randn(2, 8, 4, dtype=D, generator=torch.Generator().manual_seed(4)))
OPS: dict[str, tuple[Callable[..., Tensor], tuple[tuple[int, ...], ...]]] = {
    "entmax-1.5": (lambda x: AF.entmax(x, alpha=1.5), ((3, 7),)),
    "dnas": (lambda q, k, v: AF.doubly_normalized_attention(q, k, v), (Q, Q, Q)),
    "sinkhorn-3": (lambda q, k, v: AF.doubly_normalized_attention(q, k, v, iterations=3), (Q, Q, Q)),
    "hnas": (lambda q, k, v: AF.hybrid_normalized_attention(q, k, v, torch.tensor(0.3, dtype=D)), (Q, Q, Q)),
    "sparsemax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v, regularizer=AF.SquaredL2()),
                            (Q, Q, Q)),
    "entmax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v, regularizer=AF.Tsallis(1.5)),
                         (Q, Q, Q)),
    "softmax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v), (Q, Q, Q)),
    "generalized": (lambda q, k, v, b: AF.generalized_attention(q, k, v, log_preference=b),
                    (Q, Q, Q, (1, 2, 5, 5))),
    "rbf-p2 (sdpa)": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=RBF()), (Q, Q, Q)),
    "rbf-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=RBF(), magnitude_p=1.5), (Q, Q, Q)),
    "rff-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_RFF, magnitude_p=1.5), (Q, Q, Q)),
    "nsf-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5), (Q, Q, Q)),
    "nsf-p1.5-linear": (
        lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5, mode="linear"), (Q, Q, Q)),
    "nsf-p1.5-linear-causal": (
        lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5, mode="linear",
                                            is_causal=True), (Q, Q, Q)),
    "ot": (lambda z, t: AF.ot_attention(z, t), (Q, (2, 2, 6, 4))),
    "ot-bank-sqeuclidean": (
        lambda z, t, b, v: AF.ot_attention(z, t, bank=b, bank_values=v, cost="sqeuclidean"),
        (Q, (2, 2, 6, 4), (2, 2, 7, 4), (2, 2, 7, 4))),
}

#: every registry module with a per-token output (``ot`` pools)
MODULES = [n for n in attention_names() if n != "ot"]


def registry_module(name: str) -> torch.nn.Module:
    """``make_attention(name, 8, 2)`` in float64, eval mode, parameters moved off their
    initialization (zero last layers, identity copula)."""
    torch.manual_seed(0)
    opts = {"seed": 0} if name.startswith(("ika", "mika")) else {}
    mod = make_attention(name, 8, 2, **opts).to(D).eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mod
