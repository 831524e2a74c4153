"""Every multi-head module names the input whose feature size is wrong (before any matmul)."""
from __future__ import annotations

import pytest
import torch

from attnopt import nn as ann

E, H, KD, VD = 8, 2, 6, 5
MODULES = {
    "regularized": lambda: ann.RegularizedMultiheadAttention(E, H, kdim=KD, vdim=VD),
    "generalized": lambda: ann.GeneralizedMultiheadAttention(E, H, kdim=KD, vdim=VD),
    "dnas": lambda: ann.DoublyNormalizedMultiheadAttention(E, H, kdim=KD, vdim=VD),
    "hnas": lambda: ann.HybridNormalizedMultiheadAttention(E, H, kdim=KD, vdim=VD),
    "implicit_kernel": lambda: ann.ImplicitKernelAttention(E, H, kdim=KD, vdim=VD, seed=0),
    "mem": lambda: ann.MEMAttention(E, H, kdim=KD, vdim=VD),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_feature_sizes_are_checked(name):
    m = MODULES[name]()
    q, k, v = torch.randn(2, 3, E), torch.randn(2, 4, KD), torch.randn(2, 4, VD)
    out, _ = m(q, k, v)
    assert out.shape == (2, 3, E)
    with pytest.raises(ValueError, match=r"query has 7 features, expected embed_dim=8"):
        m(torch.randn(2, 3, 7), k, v)
    with pytest.raises(ValueError, match=r"key has 8 features, expected kdim=6"):
        m(q, torch.randn(2, 4, E), v)
    with pytest.raises(ValueError, match=r"value has 6 features, expected vdim=5"):
        m(q, k, torch.randn(2, 4, KD))
    with pytest.raises(ValueError, match="key has 8 features"):
        m(q)  # self-attention, but kdim != embed_dim
    with pytest.raises(ValueError, match="value must be"):
        m(q, k, torch.randn(4, VD))
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        m(q, [[1.0]], v)
