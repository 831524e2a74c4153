"""The train_step bench's issue-16 targets: every registry attention has a row and a target."""
from __future__ import annotations

from attnopt.bench.training import TRAIN_TARGETS, target_note
from attnopt.nn import attention_names, attention_spec


def test_every_multihead_registry_name_has_a_train_step_target():
    names = {n for n in attention_names() if attention_spec(n).multihead_convention}
    assert names == set(TRAIN_TARGETS), sorted(names ^ set(TRAIN_TARGETS))
    assert "ot" not in TRAIN_TARGETS  # pooling-only, not a drop-in self-attention


def test_target_note_says_pass_or_miss_against_the_family_factor():
    assert target_note("dnas", 1.99) == "1.99x softmax; target <= 2x (DNAS): pass"
    assert target_note("dnas", 2.01).endswith("MISS")
    assert target_note("t5", 1.25) == "1.25x softmax; target <= 1.2x (generalized): MISS"
    assert target_note("sinkhorn", 3.5).endswith("target <= 4x (Sinkhorn): pass")
    assert target_note("entmax", 3.0).endswith("(sparse): pass")
    assert target_note("mikan", 2.5).endswith("(IKA): MISS")
    assert target_note("mem", 7.0) == "7.00x softmax; no issue-16 target"
    assert target_note("softmax", 1.0) == "baseline"
