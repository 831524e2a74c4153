"""The HNAS mixing logits at their own learning rate (doubly-normalized-attention Sec. 6).

HNAS mixes LNAS and DNAS as ``w·DNAS + (1 − w)·LNAS`` with ``w = sigmoid(θ)`` and ``θ = 0`` at
the start. Adam moves a parameter by at most about its learning rate per step, so at the
model's learning rate (1e-3–3e-3) a few hundred steps cannot take ``w`` past
``sigmoid(lr × steps)`` ≈ 0.6: the paper's Fig. 3/4 question (where does ``w`` go?) cannot be
answered. The size knob ``hnas_lr`` gives every ``weight_logit`` its own learning rate (no
weight decay: decay would pull ``w`` back to 0.5); the weight can then reach
``sigmoid(± hnas_lr × steps)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["hnas_adamw"]


def hnas_adamw(model: nn.Module, lr: float, hnas_lr: float | None) -> torch.optim.Optimizer:
    """AdamW(lr) over ``model``, every parameter named ``*weight_logit`` at ``hnas_lr`` without
    weight decay (``hnas_lr=None``: one group at ``lr``, the plain optimizer).

    Raises:
        ValueError: ``hnas_lr`` not positive.
    """
    if hnas_lr is None:
        return torch.optim.AdamW(model.parameters(), lr=lr)
    if not hnas_lr > 0:
        raise ValueError(f"hnas_lr must be > 0, got {hnas_lr}")
    mix = [p for n, p in model.named_parameters() if n.endswith("weight_logit")]
    ids = {id(p) for p in mix}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups: list[dict[str, Any]] = [{"params": rest, "lr": lr}]
    if mix:
        groups.append({"params": mix, "lr": float(hnas_lr), "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=lr)
