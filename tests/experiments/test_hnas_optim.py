"""The HNAS mixing logits at their own learning rate (attnopt.experiments._hnas_optim)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnopt.experiments._hnas_optim import hnas_adamw


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.weight_logit = nn.Parameter(torch.zeros(()))


def test_mixing_logit_gets_its_own_rate_and_no_decay():
    model = _Mix()
    opt = hnas_adamw(model, 1e-3, 0.05)
    groups = {tuple(id(p) for p in g["params"]): g for g in opt.param_groups}
    mix = groups[(id(model.weight_logit),)]
    assert mix["lr"] == 0.05 and mix["weight_decay"] == 0.0
    rest = groups[tuple(id(p) for p in model.lin.parameters())]
    assert rest["lr"] == 1e-3
    # Adam moves a parameter by about its learning rate per step: 20 steps reach θ ≈ 1, w ≈ 0.73
    for _ in range(20):
        opt.zero_grad()
        (-model.weight_logit).backward()
        opt.step()
    assert 0.9 < float(model.weight_logit) < 1.1


def test_plain_optimizer_without_hnas_lr_and_bad_rate_raises():
    model = _Mix()
    assert len(hnas_adamw(model, 1e-3, None).param_groups) == 1
    with pytest.raises(ValueError, match="hnas_lr"):
        hnas_adamw(model, 1e-3, 0.0)
