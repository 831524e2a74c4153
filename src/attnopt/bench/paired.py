r"""Paired A/B timing of this attnopt against another source tree: ``attnopt bench --against PATH``.

A change's speed is judged against the code it changes, on the same machine, in the same run
(issue 30: "every ``small_n`` / ``train_step`` row within 10 % of the old main"). On a shared or
loaded machine two separate bench runs differ by more than that; this pairs them instead:

* two worker processes, one importing this checkout and one importing ``PATH/src`` (another
  checkout, e.g. a ``git worktree`` of the old commit), build the same rows
  (:func:`attnopt.bench.small_n` rows at ``N`` with ``B·H = 8``, ``d = 64``, forward or
  forward + backward; or the :mod:`attnopt.bench.training` ``train_step`` arms at ``N``),
  one thread each;
* each round runs every row once in both workers, in random order, timing thread CPU time;
* a row's figure is the **median over rounds of the per-round ratio** this ÷ other — both
  calls of a round see the same machine load, so the ratio cancels most of it. The ``sdpa``
  row (PyTorch's own, the same code in both trees) is the noise control: its ratio should be
  ~1.00; a row differs from the other tree only where its ratio leaves the control's spread.

The other tree must be an attnopt checkout that has the same private bench helpers
(``small_n._impls`` / ``_closure``, ``training._step_closure``); rows only one tree has are
left out. The workers run a small script given on the command line (:data:`WORKER`), so the
other tree needs nothing new.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import attnopt

__all__ = ["PairedRow", "WORKER", "paired_rows", "run_paired"]

#: The worker: builds the rows in the attnopt its ``PYTHONPATH`` imports, prints ``READY`` and the
#: row names, then times one call of each row named on stdin (thread CPU seconds, one per line).
WORKER = r"""
import sys, time, warnings
import torch
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
kind, n, backward, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
if kind == "train_step":
    from attnopt.bench.training import _step_closure
    from attnopt.nn import attention_names, attention_spec
    names = [x for x in attention_names() if attention_spec(x).multihead_convention and x != "mem"]
    fns = {x: _step_closure(x, n, "cpu")[0] for x in names if not rows or x in rows.split("|")}
else:
    from attnopt.bench import small_n
    impls = small_n._impls("cpu", "auto")
    g = torch.Generator().manual_seed(1)
    qkv = tuple(torch.randn(1, 8, n, 64, generator=g).requires_grad_() for _ in range(3))
    keep = [r for r in impls if not rows or r in rows.split("|")]
    fns = {r: small_n._closure(impls[r], qkv, backward) for r in keep}
for f in fns.values():
    f(); f()
print("READY " + "|".join(fns), flush=True)
for line in sys.stdin:
    t = time.thread_time(); fns[line.strip()](); print(time.thread_time() - t, flush=True)
"""


@dataclass(frozen=True)
class PairedRow:
    """One row of a paired run: the best (minimum) time of each tree and the median of the
    per-round ratios ``this / other`` with its spread (the 25th and 75th percentiles)."""

    suite: str
    case: str
    row: str
    other_ms: float
    this_ms: float
    ratio: float
    ratio_low: float
    ratio_high: float
    rounds: int


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def paired_rows(suite: str, case: str, this: dict[str, list[float]],
                other: dict[str, list[float]]) -> list[PairedRow]:
    """:class:`PairedRow` per row from the per-round times of both trees (seconds, same order)."""
    out = []
    for row, mine in this.items():
        theirs = other[row]
        ratios = [a / b for a, b in zip(mine, theirs, strict=True) if b > 0]
        if not ratios:
            continue
        low, high = _quartiles(ratios)
        out.append(PairedRow(suite, case, row, min(theirs) * 1e3, min(mine) * 1e3, statistics.median(ratios),
                             low, high, len(ratios)))
    return out


def _start(tree_src: Path, kind: str, n: int, backward: bool, rows: str, cwd: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree_src), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", WORKER, kind, str(n), "1" if backward else "0", rows],
                            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ready(proc: subprocess.Popen, tree: Path) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"the bench worker for {tree} did not start (exit code {proc.wait()}); "
                           "is it an attnopt checkout with src/attnopt and the bench helpers?")
    return [x for x in line.split(None, 1)[1].strip().split("|") if x] if " " in line.strip() else []


def _case(kind: str, n: int, backward: bool, rounds: int, rows: str, trees: dict[str, Path],
          rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    with tempfile.TemporaryDirectory() as cwd:
        procs = {name: _start(src, kind, n, backward, rows, cwd) for name, src in trees.items()}
        try:
            names = [_ready(procs[t], trees[t]) for t in trees]
            common = [r for r in names[0] if r in names[1]]
            times: dict[str, dict[str, list[float]]] = {t: {r: [] for r in common} for t in trees}
            for _ in range(rounds):
                for row in common:
                    order = list(trees)
                    rng.shuffle(order)
                    for t in order:
                        p = procs[t]
                        assert p.stdin is not None and p.stdout is not None
                        p.stdin.write(row + "\n")
                        p.stdin.flush()
                        times[t][row].append(float(p.stdout.readline()))
        finally:
            for p in procs.values():
                if p.stdin is not None:
                    p.stdin.close()
                p.wait(timeout=60)
    return times["this"], times["other"]


def run_paired(
    other: Path, *, suites: tuple[str, ...] = ("small_n", "train_step"), sizes: tuple[int, ...] | None = None,
    rounds: int = 10, rows: tuple[str, ...] = (), seed: int = 0, out: Path | None = None,
    echo: Callable[[str], None] = print,
) -> list[PairedRow]:
    """Time the ``suites`` in this checkout and in the source tree ``other``, paired (module docstring).

    Args:
        other: the other checkout (its ``src/attnopt`` is imported), e.g. a ``git worktree``.
        suites: ``"small_n"`` (forward and forward + backward at each size) and/or ``"train_step"``.
        sizes: sequence lengths (default ``small_n`` 64, 256, 1024; ``train_step`` 128).
        rounds: rounds per case (each runs every row once in both trees).
        rows: only these rows (exact names; ``sdpa`` / ``softmax`` are always kept as the control).
        seed: the order of the two trees within a round.
        out: write the rows to ``FILE.json`` or ``FILE.md``.
    Raises:
        ValueError: ``other`` has no ``src/attnopt``, an unknown suite, ``rounds < 1``.
    """
    src = Path(other).expanduser().resolve() / "src"
    if not (src / "attnopt" / "__init__.py").is_file():
        raise ValueError(f"--against {other}: no attnopt source tree there (expected {src}/attnopt)")
    bad = [s for s in suites if s not in ("small_n", "train_step")]
    if bad:
        raise ValueError(f"paired suites are small_n and train_step, got {bad}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    trees = {"this": Path(attnopt.__file__).resolve().parent.parent, "other": src}
    rng = random.Random(seed)
    results: list[PairedRow] = []
    for suite in suites:
        control = "sdpa" if suite == "small_n" else "softmax"
        keep = "|".join((control, *rows)) if rows else ""
        for n in sizes or ((64, 256, 1024) if suite == "small_n" else (128,)):
            for backward in ((False, True) if suite == "small_n" else (True,)):
                case = f"N={n} " + ("fwd+bwd" if backward else "fwd") if suite == "small_n" else f"N={n}"
                mine, theirs = _case(suite, n, backward, rounds, keep, trees, rng)
                got = paired_rows(suite, case, mine, theirs)
                results.extend(got)
                for r in got:
                    spread = f"[{r.ratio_low:.3f}, {r.ratio_high:.3f}]"
                    echo(f"{suite:10s} {case:12s} {r.row:34s} other {r.other_ms:9.2f} ms  "
                         f"this {r.this_ms:9.2f} ms  ratio {r.ratio:.3f} {spread}")
    if out is not None:
        _write(out, results, other)
    return results


def _write(out: Path, results: list[PairedRow], other: Path) -> None:
    from attnopt.report import markdown_table

    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        payload = {"other": str(other), "rows": [asdict(r) for r in results]}
        out.write_text(json.dumps(payload, indent=1) + "\n")
        return
    head = ("suite", "case", "row", "other ms", "this ms", "ratio (median of rounds)", "25–75 %")
    body = [(r.suite, r.case, r.row, round(r.other_ms, 2), round(r.this_ms, 2), round(r.ratio, 3),
             f"{r.ratio_low:.3f}–{r.ratio_high:.3f}") for r in results]
    out.write_text(f"# attnopt bench --against {other}\n\n" + markdown_table(head, body) + "\n")
