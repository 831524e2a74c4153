"""The house's layout rules (issue 30), read from the source with ``ast`` (no import runs):

* no import circle between attnopt's modules (module-level imports; imports inside functions and
  under ``TYPE_CHECKING`` are the way out of one and are not counted);
* in each mechanism family ``attnopt/functional/<family>/``, the implementation files (leaves:
  every module but ``__init__`` and ``_``-prefixed helpers) never import a leaf of any family —
  only a family's router (its ``__init__``) chooses between implementations.
"""

from __future__ import annotations

import ast
import pathlib

import attnopt

ROOT = pathlib.Path(attnopt.__file__).parent
FAMILIES = ("doubly_normalized", "generalized", "regularized", "kernel", "ot", "triton")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level_imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """attnopt modules imported by ``name`` when it is imported (not inside functions / classes)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in known else module)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _top_level_imports(name, path, known) for name, path in known.items()}


def _leaf(name: str) -> bool:
    parts = name.split(".")
    return (len(parts) == 4 and parts[1] == "functional" and parts[2] in FAMILIES
            and not parts[3].startswith("_"))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above could fail: a planted circle is reported."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_leaves_never_import_leaves() -> None:
    graph = _graph()
    leaves = [n for n in graph if _leaf(n)]
    assert len(leaves) > 20  # the families are where this test looks
    assert [(n, d) for n in leaves for d in sorted(graph[n]) if _leaf(d)] == []
