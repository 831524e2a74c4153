"""Negative controls for fenchel-dual-attention's claims (see ``tests/claims/_mutation.py``).

``fenchel_dual:ot_reduction`` gets its control from ``mutations_ot_reduction.py`` (issue 13).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.claims._mutation import Mutation


def _default_scale_one(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import generalized
    from attnopt.functional.generalized import generalized_attention

    def wrong(q, k, v, *, scale=None, **kw):  # noqa: ANN001, ANN202
        return generalized_attention(q, k, v, scale=1.0 if scale is None else scale, **kw)

    mp.setattr(generalized, "generalized_attention", wrong)


def _t5_bucket_off_by_one(mp: pytest.MonkeyPatch) -> None:
    from attnopt.nn import preference

    real = preference.relative_position_bucket
    mp.setattr(preference, "relative_position_bucket", lambda rel, **kw: real(rel + 1, **kw))


def _dual_with_wrong_alpha(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import mem
    from attnopt.dual import solve_mem

    mp.setattr(mem, "solve_mem", lambda t, z, *, alpha=1.0, **kw: solve_mem(t, z, alpha=1.1 * alpha, **kw))


def _second_order_is_first_order(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import mem
    from attnopt.dual import approx_lambda

    mp.setattr(mem, "approx_lambda", lambda t, z, *, order=1, **kw: approx_lambda(t, z, order=1, **kw))


def _gaussian_alpha_doubled(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import mem
    from attnopt.dual import gaussian_mem

    mp.setattr(mem, "gaussian_mem", lambda mu, b, alpha: gaussian_mem(mu, b, 2 * alpha))


def _generalized_ignores_preference(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import mem
    from attnopt.functional.generalized import generalized_attention

    mp.setattr(
        mem,
        "generalized_attention",
        lambda q, k, v, *, preference=None, **kw: generalized_attention(q, k, v, **kw),
    )


def _true_preference_gamma_doubled(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import ot
    from attnopt.dual.ot import true_preference

    mp.setattr(
        ot, "true_preference", lambda t, u, *, gamma=1.0, **kw: true_preference(t, u, gamma=2 * gamma, **kw)
    )


def _eq22_alpha_wrong(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import ot
    from attnopt.functional.ot import ot_attention

    mp.setattr(
        ot, "ot_attention", lambda z, t, *, alpha=1.0, **kw: ot_attention(z, t, alpha=1.5 * alpha, **kw)
    )


def _ot_ignores_cost(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import ot
    from attnopt.functional.ot import ot_weights

    mp.setattr(
        ot, "ot_weights", lambda z, t, *, cost, **kw: ot_weights(z, t, cost=torch.zeros_like(cost), **kw)
    )


def _fresh_capture(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims.fenchel_dual import pretrained

    mp.setattr(pretrained, "_CACHE", {})  # the mutated code must be measured, not a cached capture


def _eq19_wrong_scaling(mp: pytest.MonkeyPatch) -> None:
    dual_deviation = importlib.import_module(
        "attnopt.analysis.dual_deviation"
    )  # the module, not the function

    _fresh_capture(mp)
    real = dual_deviation.eq19_mapping
    mp.setattr(
        dual_deviation, "eq19_mapping", lambda *a, scaling, **kw: real(*a, scaling=1.5 * scaling, **kw)
    )


def _pretrained_dnas_wrong_order(mp: pytest.MonkeyPatch) -> None:
    import attnopt.functional
    from tests.claims.mutations_doubly_normalized import _dnas_wrong_order

    _fresh_capture(mp)
    mp.setattr(attnopt.functional, "doubly_normalized_weights", _dnas_wrong_order)


MUTATIONS = [
    Mutation("fenchel_dual:eq16", "default scale 1 instead of 1/sqrt(d)", _default_scale_one),
    Mutation("fenchel_dual:eq18", "T5 relative-position bucket off by one", _t5_bucket_off_by_one),
    Mutation("fenchel_dual:thm1", "dual solved with alpha off by 10%", _dual_with_wrong_alpha),
    Mutation("fenchel_dual:eq13_14", "(13) replaced by the first-order (14)", _second_order_is_first_order),
    Mutation("fenchel_dual:gaussian", "closed form with alpha doubled", _gaussian_alpha_doubled),
    Mutation("fenchel_dual:fig3", "(16) ignores the preference u", _generalized_ignores_preference),
    Mutation(
        "fenchel_dual:ot_prop1", "true preference (37) with gamma doubled", _true_preference_gamma_doubled
    ),
    Mutation("fenchel_dual:ot_eq22", "(22) with alpha off by 50%", _eq22_alpha_wrong),
    Mutation("fenchel_dual:ot_groups", "OT weights ignore the cost M", _ot_ignores_cost),
    # unmutated this claim is "partially reproduced" (no depth trend on MiniLM): the control must reach "not"
    Mutation(
        "fenchel_dual:sec8_bert",
        "eq. (19) mapping with the wrong 1/sqrt(d') scaling",
        _eq19_wrong_scaling,
        expect=("not reproduced",),
    ),
    Mutation(
        "fenchel_dual:sec8_explaining_away",
        "DNAS normalizes rows first, then columns",
        _pretrained_dnas_wrong_order,
    ),
]
