"""Column-mass logger (explaining away, Fig. 1) and HNAS weight readout."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.experiments._diagnostics import ColumnMassLogger, column_mass_summary, hnas_weights
from attnopt.nn import DoublyNormalizedMultiheadAttention, HybridNormalizedMultiheadAttention


def test_column_mass_summary_hand_computed() -> None:
    # masses: [0.7, 1.2, 0.1]; Nk = 3, threshold 1/30
    w = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.7, 0.1]]])
    s = column_mass_summary(w)
    assert s["min_column_mass"] == pytest.approx(0.1)
    assert s["min_column_mass_x_nk"] == pytest.approx(0.3)
    assert s["frac_explained_away"] == 0.0 and s["n_keys"] == 3
    # key 2 gets 0.01 < 1/30: one of three keys explained away
    w2 = torch.tensor([[[0.5, 0.5, 0.0], [0.29, 0.7, 0.01]]])
    assert column_mass_summary(w2)["frac_explained_away"] == pytest.approx(1 / 3)


def test_column_mass_summary_masks() -> None:
    # sample 0: key 2 is padding (its zero mass must not count), query 1 is padding
    w = torch.tensor([[[0.6, 0.4, 0.0], [0.0, 0.0, 1.0]],
                      [[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]])
    kpm = torch.tensor([[False, False, True], [False, False, False]])
    qpm = torch.tensor([[False, True], [False, False]])
    s = column_mass_summary(w, key_padding_mask=kpm, query_padding_mask=qpm, ratio=1.0)
    # sample 0 masses (real keys) [0.6, 0.4], Nk = 2 -> threshold 0.5: 0.4 below
    # sample 1 masses [0.3, 0.4, 1.3], Nk = 3 -> threshold 1/3: 0.3 below
    assert s["min_column_mass"] == pytest.approx(0.3)
    assert s["min_column_mass_x_nk"] == pytest.approx(0.8)
    assert s["frac_explained_away"] == pytest.approx(2 / 5) and s["n_keys"] == 5
    with pytest.raises(ValueError, match="key_padding_mask"):
        column_mass_summary(w, key_padding_mask=kpm[:, :2])
    with pytest.raises(ValueError, match="ratio"):
        column_mass_summary(w, ratio=0)


def test_logger_captures_lemma1_bound_and_leaves_model_alone() -> None:
    torch.manual_seed(0)
    lnas = DoublyNormalizedMultiheadAttention(16, 2, iterations=0)
    dnas = DoublyNormalizedMultiheadAttention(16, 2, iterations=1)
    q, kv = torch.randn(4, 5, 16) * 4, torch.randn(4, 9, 16) * 4
    for mod, name in ((lnas, "lnas"), (dnas, "dnas")):
        with ColumnMassLogger(mod) as log:
            out, w = mod(q, kv, kv)
        assert w is None  # the caller still gets what it asked for
        ref = column_mass_summary(mod(q, kv, kv, need_weights=True, average_attn_weights=False)[1])
        s = log.summary()
        assert s["min_column_mass"] == pytest.approx(ref["min_column_mass"])
        assert s["frac_explained_away"] == pytest.approx(ref["frac_explained_away"])
        if name == "dnas":
            assert s["min_column_mass_x_nk"] >= 1 - 1e-6  # Lemma 1
    assert not lnas._forward_hooks and not lnas._forward_pre_hooks
    assert math.isnan(ColumnMassLogger(lnas).summary()["min_column_mass"])


def test_logger_self_attention_drops_padding_queries() -> None:
    torch.manual_seed(1)
    mod = DoublyNormalizedMultiheadAttention(8, 1, iterations=1)
    x = torch.randn(2, 6, 8)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    with ColumnMassLogger(mod) as log:
        mod(x, key_padding_mask=kpm)
    w = mod(x, need_weights=True, average_attn_weights=False, key_padding_mask=kpm)[1]
    ref = column_mass_summary(w, key_padding_mask=kpm, query_padding_mask=kpm)
    assert log.summary()["min_column_mass"] == pytest.approx(ref["min_column_mass"])
    assert ref["n_keys"] == 10


def test_hnas_weights_bounded() -> None:
    model = torch.nn.Sequential(HybridNormalizedMultiheadAttention(8, 2, init_weight=0.3),
                                DoublyNormalizedMultiheadAttention(8, 2),
                                HybridNormalizedMultiheadAttention(8, 2, init_weight=0.9, per_head=True))
    w = hnas_weights(model)
    assert list(w) == ["hnas_w/0", "hnas_w/1"]
    assert w["hnas_w/0"] == pytest.approx(0.3) and w["hnas_w/1"] == pytest.approx(0.9)
    with torch.no_grad():
        model[0].weight_logit.fill_(50.0)
    assert 0.0 < hnas_weights(model)["hnas_w/0"] <= 1.0


def test_padding_from_mask_and_logger_with_attn_mask() -> None:
    from attnopt.experiments._diagnostics import padding_from_mask

    kp = torch.tensor([[False, False, True], [False, False, False]])
    qp = torch.tensor([[False, True, False], [False, False, False]])
    mask = (kp[:, None, None, :] | qp[:, None, :, None])
    keys, queries = padding_from_mask(mask, 2, 3, 3)
    # query 1 of sample 0 is padding; key 2 of sample 0 is padding
    assert torch.equal(keys, kp) and torch.equal(queries, qp)
    causal = torch.ones(3, 3, dtype=torch.bool).triu(1)
    assert padding_from_mask(causal, 2, 3, 3) is None
    additive = torch.zeros(2, 1, 3, 3).masked_fill(mask, float("-inf"))
    assert torch.equal(padding_from_mask(additive, 2, 3, 3)[0], kp)
    # keys-only mask broadcast over queries (cross-attention without padded queries)
    keys, queries = padding_from_mask(kp[:, None, None, :], 2, 4, 3)
    assert torch.equal(keys, kp) and not queries.any() and queries.shape == (2, 4)
    torch.manual_seed(2)
    mod = DoublyNormalizedMultiheadAttention(8, 2, iterations=1)
    x = torch.randn(2, 3, 8)
    with ColumnMassLogger(mod) as log:
        mod(x, attn_mask=mask)
    w = mod(x, attn_mask=mask, need_weights=True, average_attn_weights=False)[1]
    ref = column_mass_summary(w, key_padding_mask=kp, query_padding_mask=qp)
    assert log.summary()["min_column_mass"] == pytest.approx(ref["min_column_mass"]) and ref["n_keys"] == 10
    with ColumnMassLogger(mod) as log:
        mod(x, attn_mask=causal)
    assert math.isnan(log.summary()["min_column_mass"])  # causal calls are not counted
