"""attnopt._extras: which extra provides which module, and the messages when one is missing."""
import sys

import pytest

from attnopt import _extras
from attnopt.claims import ClaimContext, ClaimResult, claim
from attnopt.claims._registry import _REGISTRY
from attnopt.claims._runner import run_claims


def test_extra_for_module_maps_submodules_to_their_extra():
    assert _extras.extra_for_module("ot.bregman") == "oracles"
    assert _extras.extra_for_module("matplotlib.pyplot") == "plots"
    assert _extras.extra_for_module("lightning") == "train"
    assert _extras.extra_for_module("numpy") is None


def test_missing_modules_sees_a_blocked_import(monkeypatch):
    assert _extras.missing_modules("plots") == []
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _extras.missing_modules("plots") == ["matplotlib"]
    with pytest.raises(_extras.MissingExtraError, match=r"pip install 'attnopt\[plots\]'") as info:
        _extras.require("plots", what="a figure")
    assert info.value.extra == "plots" and info.value.modules == ("matplotlib",)
    assert isinstance(info.value, ImportError)


def test_missing_modules_rejects_an_unknown_extra():
    with pytest.raises(ValueError, match="extra must be one of"):
        _extras.missing_modules("plot")


def test_as_missing_extra_only_converts_optional_modules():
    known = _extras.as_missing_extra(ModuleNotFoundError("x", name="sacrebleu.metrics"), "a task")
    assert known is not None and known.extra == "train" and "attnopt[train]" in str(known)
    assert _extras.as_missing_extra(ModuleNotFoundError("x", name="not_an_extra"), "a task") is None


def test_claim_rejects_an_unknown_extra():
    with pytest.raises(ValueError, match="requires: unknown extras"):
        claim(paper="t", key="k", title="t", reference="r", requires=("plotz",))


@pytest.fixture
def temp_claims(monkeypatch):
    """Register throw-away claims under a test paper, removed afterwards."""
    added: list[str] = []

    def add(key, func, requires=()):
        claim(paper="extras_test", key=key, title=key, reference="-", requires=requires)(func)
        added.append(f"extras_test:{key}")

    monkeypatch.setattr("attnopt.claims._registry._import_claim_modules", lambda: None)
    yield add
    for cid in added:
        _REGISTRY.pop(cid, None)


def _ok(ctx: ClaimContext) -> ClaimResult:
    return ClaimResult("reproduced", "fine", {"x": 1.0})


def _imports_optional(ctx: ClaimContext) -> ClaimResult:
    import sacrebleu  # noqa: F401  (blocked by the test)

    return _ok(ctx)


def _imports_unknown(ctx: ClaimContext) -> ClaimResult:
    import attnopt_no_such_module  # noqa: F401

    return _ok(ctx)


def test_runner_skips_declared_and_undeclared_missing_extras(temp_claims, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "sacrebleu", None)
    temp_claims("declared", _ok, requires=("plots",))
    temp_claims("undeclared", _imports_optional)
    temp_claims("bug", _imports_unknown)
    temp_claims("fine", _ok)
    runs = {r.claim.key: r for r in run_claims(quick=True, out_dir=tmp_path, only="extras_test")}
    assert runs["declared"].verdict == "skipped"
    assert "pip install 'attnopt[reproduce]'" in runs["declared"].skip_reason
    assert "matplotlib" in runs["declared"].skip_reason
    assert runs["undeclared"].verdict == "skipped" and "sacrebleu" in runs["undeclared"].skip_reason
    assert runs["bug"].verdict == "error"  # a missing non-optional module is a bug, not a skip
    assert runs["fine"].verdict == "reproduced"


def test_every_registered_claim_declares_known_extras():
    from attnopt.claims import all_claims

    for c in all_claims():
        assert set(c.requires) <= set(_extras.EXTRA_MODULES), c.id
