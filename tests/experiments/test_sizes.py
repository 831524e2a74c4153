"""``--size`` keys: every key a task reads is declared, unknown keys are rejected by name."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from attnopt.experiments import get_task, task_names
from attnopt.experiments._engine import plan_runs


def _keys_read(task) -> set[str]:
    """String keys of ``cfg.sizes.get(k)``, ``cfg.size(k)``, ``sizes.get(k)``, ``s.get(k)`` in its file."""
    src = Path(sys.modules[type(task).__module__].__file__).read_text(encoding="utf-8")
    out = set()
    for node in ast.walk(ast.parse(src)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        arg, recv = node.args[0], ast.unparse(node.func.value)
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            continue
        if (node.func.attr == "get" and recv in ("cfg.sizes", "sizes", "s")) or (
            node.func.attr == "size" and recv == "cfg"
        ):
            out.add(arg.value)
    return out


@pytest.mark.parametrize("name", task_names())
def test_every_size_a_task_reads_is_a_valid_key(name: str) -> None:
    task = get_task(name)
    read = _keys_read(task)
    assert read, "the scan found no size reads: it is broken"
    assert read <= set(task.size_keys()), sorted(read - set(task.size_keys()))


def test_unknown_size_is_rejected_naming_the_valid_ones(tmp_path: Path) -> None:
    task = get_task("ot-vit")
    with pytest.raises(ValueError, match=r"no size 'd_modle'; valid sizes: .*d_model"):
        plan_runs(task, quick=True, sizes={"d_modle": 16}, out_dir=tmp_path)
    cfgs = plan_runs(task, quick=True, sizes={"d_model": 16, "bank_p": 0.3}, out_dir=tmp_path)
    assert cfgs[0].sizes["d_model"] == 16 and cfgs[0].sizes["bank_p"] == 0.3
