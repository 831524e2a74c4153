"""Negative controls for sdpa-one-sided-eot's claims (see ``tests/claims/_mutation.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.claims._mutation import Mutation


def _eot_temperature_doubled(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import one_sided_eot
    from attnopt.functional import Shannon

    mp.setattr(one_sided_eot, "Shannon", lambda t=1.0: Shannon(2 * t))


def _alibi_sign_flipped(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import one_sided_eot
    from attnopt.functional import locality_bias

    mp.setattr(one_sided_eot, "locality_bias", lambda nq, nk, beta, **kw: -locality_bias(nq, nk, beta, **kw))


def _alibi_quadratic(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import one_sided_eot
    from attnopt.functional import locality_bias

    mp.setattr(
        one_sided_eot,
        "locality_bias",
        lambda nq, nk, beta, **kw: -(locality_bias(nq, nk, 1.0, **kw) ** 2) * beta,
    )


def _sparsemax_is_softmax(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import one_sided_eot

    mp.setattr(one_sided_eot, "sparsemax", lambda s: torch.softmax(s, -1))


def _policy_gradient_sign_flipped(mp: pytest.MonkeyPatch) -> None:
    from attnopt.analysis import policy

    real = policy.policy_gradient
    mp.setattr(policy, "policy_gradient", lambda p, u, **kw: -real(p, u, **kw))


def _library_alibi_sign_flipped(mp: pytest.MonkeyPatch) -> None:
    from attnopt.functional import regularized

    real = regularized.locality_bias
    mp.setattr(regularized, "locality_bias", lambda nq, nk, beta, **kw: -real(nq, nk, beta, **kw))


MUTATIONS = [
    Mutation(
        "one_sided_eot:thm33", "Shannon regularizer with twice the temperature", _eot_temperature_doubled
    ),
    Mutation("one_sided_eot:prop41_44", "ALiBi offset with the sign flipped", _alibi_sign_flipped),
    Mutation("one_sided_eot:prop41_44", "ALiBi offset quadratic in |i-j|", _alibi_quadratic),
    Mutation("one_sided_eot:prop41_44", "sparsemax replaced by softmax", _sparsemax_is_softmax),
    Mutation(
        "one_sided_eot:thm52_thm73_cor75",
        "Thm 5.2 gradient with the sign flipped",
        _policy_gradient_sign_flipped,
    ),
    Mutation(
        "one_sided_eot:table1", "library ALiBi rewards distance (sign flipped)", _library_alibi_sign_flipped
    ),
]
