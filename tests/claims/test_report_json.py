"""report.json: one record per claim beside report.md/html, validated against its JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnopt.claims import ClaimResult
from attnopt.claims._registry import Claim
from attnopt.claims._report_json import SCHEMA
from attnopt.claims._runner import ClaimRun, run_claims, write_claims_report
from attnopt.claims._verdict import effect_of, sanity_gate, training_record

jsonschema = pytest.importorskip("jsonschema")


def _claim(key: str) -> Claim:
    return Claim(paper="demo", key=key, title=f"demo {key}", reference="eq. (1)", func=lambda ctx: None)  # noqa: ARG005


def _runs() -> list[ClaimRun]:
    gate = sanity_gate({"a": 0.55, "b": 0.5}, name="logistic regression", value=0.97, margin=0.01)
    training = training_record(metric="accuracy", higher_is_better=True, arms={"a": [0.5, 0.6], "b": [0.5]},
                               gate=gate, effect=effect_of([0.1, 0.0], paper=0.03))
    trained = ClaimResult("inconclusive", "s", {"x": float("nan"), "y": 2}, reason=gate.reason,
                          training=training)
    theory = ClaimResult("reproduced", "exact", {"err": 1e-15})
    return [
        ClaimRun(_claim("theory"), theory, None, 0.1, []),
        ClaimRun(_claim("trained"), trained, None, 2.0, []),
        ClaimRun(_claim("skip"), None, None, 0.0, [], skip_reason="needs extra 'hf'"),
        ClaimRun(_claim("boom"), None, "Traceback\nValueError: bad", 0.0, []),
    ]


def test_report_json_matches_its_schema_and_carries_each_claim(tmp_path: Path):
    write_claims_report(_runs(), tmp_path, quick=True, wall_s=3.0)
    doc = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["scale"] == "quick" and doc["versions"]["torch"] and "python" in doc["versions"]
    by_id = {c["id"]: c for c in doc["claims"]}
    assert by_id["demo:theory"]["training"] is None and by_id["demo:theory"]["verdict"] == "reproduced"
    t = by_id["demo:trained"]
    assert t["verdict"] == "inconclusive" and t["reason"].startswith("undertrained: best arm a 0.55")
    assert t["figures"]["x"] is None  # NaN is not JSON
    assert t["training"]["baseline"] == {"name": "logistic regression", "value": 0.97, "passed": False,
                                         "margin": 0.01}
    assert t["training"]["effect"]["paper"] == 0.03 and t["training"]["arms"]["b"]["ci95"] is None
    assert by_id["demo:skip"]["verdict"] == "skipped" and by_id["demo:boom"]["reason"] == "ValueError: bad"


def test_schema_rejects_a_record_without_its_verdict(tmp_path: Path):
    write_claims_report(_runs(), tmp_path, quick=False, scale="standard")
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["scale"] == "standard"
    del doc["claims"][0]["verdict"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)
    doc["claims"][0]["verdict"] = "sort of"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


def test_a_real_run_writes_valid_json(tmp_path: Path):
    runs = run_claims(quick=True, out_dir=tmp_path, only="implicit_kernel:prop1")
    write_claims_report(runs, tmp_path, quick=True)
    doc = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert [c["id"] for c in doc["claims"]] == ["implicit_kernel:prop1"]
