"""The analyze pipeline on a random T5 (all three attention kinds) and its report files."""
import json

import torch

from attnopt.analysis.analyze import analyze_model
from attnopt.analysis.analyze_report import write_analysis
from tests.reference.hf_tiny import padded_batch, tiny_t5


def test_t5_pipeline_and_report(tmp_path):
    ids, mask = padded_batch(7)
    result = analyze_model(tiny_t5(), ids, mask, model_name="tiny T5 (random init)", progress=False)
    assert result.kinds == ["self", "decoder_self", "cross"]
    assert not result.reconstruction_failures
    for s in result.sites:
        assert s.deviation.converged and s.deviation.reconstruction_error < 1e-5
        assert 0 < s.mean < 1 and torch.isfinite(s.head_means).all()
    # padded encoder queries are not covered; the decoder mask is the shifted one
    enc = result.by_kind("self")[0].deviation.query_mask
    assert enc[1, :5].all() and not enc[1, 5:].any()
    paths = write_analysis(result, tmp_path)
    for key in ("md", "html", "json", "csv", "deviation_by_layer", "deviation_by_head_self",
                "deviation_by_head_decoder_self", "deviation_by_head_cross", "lenses"):
        assert paths[key].is_file() and paths[key].stat().st_size > 0
    doc = json.loads(paths["json"].read_text())
    assert set(doc["per_layer_mean"]) == {"self", "decoder_self", "cross"}
    assert "paper T5-small" in paths["md"].read_text()
    md = paths["md"].read_text()
    assert "## Papers" in md  # cited by title
    assert "Deciphering Attention Mechanisms" in md and "Implicit Kernel Attention" in md
