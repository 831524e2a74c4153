"""fenchel-dual eq. (16) and eq. (18) claims reproduce (negative controls: mutations_fenchel_dual.py)."""
from pathlib import Path

import pytest

from attnopt.claims import ClaimContext
from attnopt.claims.fenchel_dual import generalized as claims


def test_eq16_reproduces(tmp_path: Path):
    res = claims.uniform_preference_is_dot_product(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced" and res.figures["max_abs_error"] < 1e-12


def test_eq18_reproduces_against_hf_t5(tmp_path: Path):
    pytest.importorskip("transformers")
    res = claims.t5_is_generalized_attention(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "reproduced"
    assert res.figures["encoder_max_abs_diff"] < 1e-10 and res.figures["decoder_max_abs_diff"] < 1e-10

