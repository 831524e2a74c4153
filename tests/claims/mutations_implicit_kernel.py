"""Negative controls for implicit-kernel-attention's claims (see ``tests/claims/_mutation.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.claims._mutation import Mutation


def _magnitude_drops_keys(mp: pytest.MonkeyPatch) -> None:
    from attnopt.analysis.decompose import Decomposition, decompose
    from attnopt.claims.implicit_kernel import identities

    def wrong(q, k, **kw):  # noqa: ANN001, ANN202
        sim, mag = decompose(q, k, **kw)
        key_term = torch.exp(k.pow(2).sum(-1) / (2 * math.sqrt(q.shape[-1]))).unsqueeze(-2)
        return Decomposition(sim, mag / key_term)

    mp.setattr(identities, "decompose", wrong)


def _gat_slope_ignored(mp: pytest.MonkeyPatch) -> None:
    from attnopt.analysis.decompose import decompose_gat
    from attnopt.claims.implicit_kernel import identities

    mp.setattr(
        identities,
        "decompose_gat",
        lambda xq, xk, att, *, negative_slope=0.2, **kw: decompose_gat(xq, xk, att, negative_slope=1.0, **kw),
    )


def _rff_wrong_lengthscale(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.implicit_kernel import approximation
    from attnopt.kernels import RandomFourier

    class Wrong:
        @staticmethod
        def rbf(r, d, lengthscale, **kw):  # noqa: ANN001, ANN205
            return RandomFourier.rbf(r, d, lengthscale * math.sqrt(2), **kw)

    mp.setattr(approximation, "RandomFourier", Wrong)


def _ns_wrong_std(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.implicit_kernel import approximation
    from attnopt.kernels import NonStationaryFourier

    class Wrong:
        @staticmethod
        def gaussian(r, d, s1, s2, **kw):  # noqa: ANN001, ANN205
            return NonStationaryFourier.gaussian(r, d, 1.5 * s1, s2, **kw)

    mp.setattr(approximation, "NonStationaryFourier", Wrong)


def _ties_to_first_index(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.implicit_kernel import sparsity
    from attnopt.functional.kernel import kernel_weights

    def wrong(q, k, **kw):  # noqa: ANN001, ANN202
        w = kernel_weights(q, k, **kw)
        tie = (w[..., 0] - w[..., 1]).abs() <= 1e-12 * w[..., 0].abs().clamp_min(1e-300)
        w = w.clone()
        w[..., 0] = torch.where(tie, w[..., 0] + w[..., 1], w[..., 0])
        w[..., 1] = torch.where(tie, torch.zeros_like(w[..., 1]), w[..., 1])
        return w

    mp.setattr(sparsity, "kernel_weights", wrong)


def _linear_mode_is_quadratic(mp: pytest.MonkeyPatch) -> None:
    from attnopt.functional.kernel import kernel_attention
    from attnopt.nn import implicit_kernel

    mp.setattr(
        implicit_kernel,
        "kernel_attention",
        lambda *a, mode="quadratic", **kw: kernel_attention(*a, mode="quadratic", **kw),
    )


MUTATIONS = [
    Mutation("implicit_kernel:prop1", "magnitude term drops ||k||^2", _magnitude_drops_keys),
    Mutation("implicit_kernel:prop2", "LeakyReLU slope ignored (c = 1 on both sides)", _gat_slope_ignored),
    Mutation(
        "implicit_kernel:prop3", "spectral samples with length-scale off by sqrt(2)", _rff_wrong_lengthscale
    ),
    Mutation("implicit_kernel:prop4", "first spectral density's std off by 50%", _ns_wrong_std),
    Mutation("implicit_kernel:prop5", "ties broken by the first index", _ties_to_first_index),
    Mutation(
        "implicit_kernel:table1", "linear mode silently runs the quadratic path", _linear_mode_is_quadratic
    ),
]
