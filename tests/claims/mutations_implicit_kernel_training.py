"""Negative controls for the trained implicit-kernel claims (Tables 2–5, Figs. 3–5).

Each mutation shrinks the claim's quick run to a few seconds (tiny scale, two seeds or folds)
and breaks what the claim is about; the verdict must then not be "reproduced":

* the IKA arms silently run SDPA (GAT for graphs): every arm trains the same model, so no IKA
  arm can beat the baseline (Tables 2–5) and no arm's magnitude is more stable (Fig. 3);
* ``p`` is dropped when an arm is built: MIKAN at every p is the same model (Fig. 4);
* MIKAN's graph layers are GAT's: its heads cannot be more diverse than GAT's and it has no
  learned spectral density to test against GAT's Gaussian (Fig. 5a-d).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.claims._mutation import Mutation, gateless


def _tiny(mp: pytest.MonkeyPatch, task_name: str, **plan) -> None:
    """Shrink a task's quick scale (and the claim's quick plan) to a few-second run."""
    import importlib

    from attnopt.claims.implicit_kernel import training

    gateless(mp)
    module = {
        "sentence-classification": "ika_sentence_classification",
        "translation": "ika_translation",
        "regression": "ika_regression",
        "node-classification": "ika_node_classification",
    }[task_name]
    task = importlib.import_module(f"attnopt.experiments.{module}").TASK
    scale = task.quick
    tiny = {"d_model": 8, "num_heads": 2, "num_layers": 1, "layers": 1, "num_samples": 4, "max_len": 8,
            "hidden": 4, "heads": 2, "high": 120, "folds": 2}
    new_plan = {**training.QUICK[task_name], **plan}
    new_plan.pop("epochs", None)  # the tiny scale's one epoch
    seeds = 1 if new_plan.get("folds") else 2  # two folds or two seeds: a CI, at the least cost
    mp.setattr(task, "quick", replace(scale, epochs=1, seeds=seeds, sizes={**scale.sizes, **tiny}))
    new_plan["sizes"] = {**new_plan.get("sizes", {}), **tiny}
    if new_plan.get("folds"):
        new_plan["folds"] = 2
    mp.setitem(training.QUICK, task_name, new_plan)
    mp.setattr(training, "_CACHE", {})


def _all_sdpa(mp: pytest.MonkeyPatch, module: str) -> None:
    import importlib

    from attnopt.experiments import _ika

    mod = importlib.import_module(f"attnopt.experiments.{module}")
    original = _ika.arm_options
    mp.setattr(mod, "arm_options", lambda arm, **kw: original("transformer", **kw))


def _sentence_sdpa(mp: pytest.MonkeyPatch) -> None:
    _tiny(mp, "sentence-classification", arms=("transformer", "ikan"))
    _all_sdpa(mp, "ika_sentence_classification")


def _translation_sdpa(mp: pytest.MonkeyPatch) -> None:
    _tiny(mp, "translation")
    _all_sdpa(mp, "ika_translation")


def _regression_sdpa(mp: pytest.MonkeyPatch) -> None:
    _tiny(mp, "regression", arms=("transformer", "ikan-direct", "mikan"))
    _all_sdpa(mp, "ika_regression")


def _regression_p_dropped(mp: pytest.MonkeyPatch) -> None:
    from attnopt.experiments import _ika, ika_regression

    _tiny(mp, "regression", arms=("mikan-p0.25", "mikan-p2"))
    original = _ika.arm_options
    mp.setattr(ika_regression, "arm_options", lambda arm, **kw: original(arm.split("-p")[0], **kw))


def _graph_all_gat(mp: pytest.MonkeyPatch) -> None:
    from attnopt.experiments import ika_node_classification as nc

    _tiny(mp, "node-classification")
    original = nc.GraphAttentionNet.__init__

    def gat_init(self, arm, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, "gat", *args, **kwargs)

    mp.setattr(nc.GraphAttentionNet, "__init__", gat_init)


MUTATIONS = [
    Mutation(claim="implicit_kernel:table2", what="IKA arms silently run SDPA", patch=_sentence_sdpa),
    Mutation(claim="implicit_kernel:table3", what="IKA arms silently run SDPA", patch=_translation_sdpa),
    Mutation(claim="implicit_kernel:fig3", what="IKA arms silently run SDPA", patch=_translation_sdpa),
    Mutation(claim="implicit_kernel:table4", what="IKA arms silently run SDPA", patch=_regression_sdpa),
    Mutation(claim="implicit_kernel:fig4", what="p dropped when MIKAN is built", patch=_regression_p_dropped),
    Mutation(claim="implicit_kernel:table5", what="kernel graph layers are GAT", patch=_graph_all_gat),
    Mutation(claim="implicit_kernel:fig5", what="kernel graph layers are GAT", patch=_graph_all_gat),
]
