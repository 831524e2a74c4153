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


def _potential_without_temperature(mp: pytest.MonkeyPatch) -> None:
    """φ(s) = logsumexp(s/τ) (τ dropped): its gradient is softmax/τ, its value off by τ."""
    from attnopt.claims import one_sided_eot_duality as mod

    mp.setattr(mod, "dual_potential", lambda s, t: torch.logsumexp(s / t, dim=-1))


def _conjugate_at_double_temperature(mp: pytest.MonkeyPatch) -> None:
    """The supremum of eq. (149) taken with Ω at 2τ (the conjugate of another regularizer)."""
    from attnopt.claims import one_sided_eot_duality as mod
    from attnopt.functional import Shannon

    mp.setattr(mod, "Shannon", lambda t=1.0: Shannon(2 * t))


def _fisher_without_outer_product(mp: pytest.MonkeyPatch) -> None:
    """F = diag(p)/τ² (the −ppᵀ dropped): invertible, F·1 = p/τ² ≠ 0."""
    from attnopt.claims import one_sided_eot_duality as mod

    mp.setattr(mod, "fisher_matrix", lambda w, temperature=1.0: torch.diag_embed(w) / temperature**2)


def _fisher_over_tau(mp: pytest.MonkeyPatch) -> None:
    """F = (diag p − ppᵀ)/τ (one power of τ short): the natural gradient is off by τ."""
    from attnopt.analysis.policy import fisher_matrix
    from attnopt.claims import one_sided_eot_duality as mod

    mp.setattr(mod, "fisher_matrix",
               lambda w, temperature=1.0: fisher_matrix(w, temperature=temperature) * temperature)


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
    Mutation("one_sided_eot:thm63_eq149", "potential without the temperature",
             _potential_without_temperature),
    Mutation("one_sided_eot:thm63_eq149", "conjugate of Ω at 2τ", _conjugate_at_double_temperature),
    Mutation("one_sided_eot:thm73_pinv", "Fisher matrix without −ppᵀ", _fisher_without_outer_product),
    Mutation("one_sided_eot:thm73_pinv", "Fisher matrix over τ, not τ²", _fisher_over_tau),
]
