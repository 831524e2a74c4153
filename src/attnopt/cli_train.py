"""``attnopt train``: the papers' training experiments on PyTorch Lightning.

``attnopt train --list`` prints every task, the paper table it reproduces and its arms;
``attnopt train TASK [--arms A,B] [--seeds N] [--epochs E] [--lr X,Y] [--batch-size B]
[--quick] [--devices N] [--strategy ddp] [--dataset NAME] [--data-dir DIR] [--out DIR]
[--resume | --overwrite] [--size KEY=VALUE ...]`` runs one Lightning fit per (arm, seed, lr)
and writes ``OUT/results.json``, ``OUT/results.md``, ``OUT/figures/`` and per-run logs and
checkpoints. ``attnopt train TASK --list-sizes`` (or ``--size help``) prints the task's size
keys. Exit 0 on success, 2 on bad input (one ``error:`` line, no traceback), 130 on Ctrl-C
(with the hint to continue with ``--resume``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_train_parser"]

_NEEDS = "error: attnopt train needs the 'train' extra: pip install 'attnopt[train]'"


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to ``attnopt``'s sub-parsers."""
    p = subparsers.add_parser("train", help="train the papers' experiments (Lightning; --list for the tasks)")
    p.add_argument("task", nargs="?", default=None, help="task name (see --list)")
    p.add_argument("--list", action="store_true", help="list the tasks, their paper tables and arms")
    p.add_argument("--arms", default=None, help="comma-separated arms (default: the paper's rows)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the scale's)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", default=None, help="learning rate(s), comma-separated (default: the paper's grid)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="the task's reduced scale")
    p.add_argument("--devices", type=int, default=1, help="processes/GPUs (Lightning devices)")
    p.add_argument("--strategy", default="auto", help="Lightning strategy, e.g. ddp")
    p.add_argument("--dataset", default=None, help="data set (default: the task's offline one)")
    p.add_argument("--data-dir", default=None, help="folder with the paper's data files")
    p.add_argument("--out", default=None, help="output folder (default attnopt-train/TASK)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue unfinished runs, skip finished ones")
    again.add_argument(
        "--overwrite", action="store_true", help="start over in an OUT that holds runs of these configs"
    )
    p.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task size knob (repeatable), e.g. --size d_model=16; --list-sizes shows the keys",
    )
    p.add_argument("--list-sizes", action="store_true", help="list the task's --size keys and defaults")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per process (0 = automatic)")
    p.add_argument("--no-progress", action="store_true", help="hide Lightning's progress bar")
    p.set_defaults(func=_cmd_train)
    return p


def _parse_lrs(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--lr must be positive numbers, got {part!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise ValueError(f"--lr must be positive numbers, got {part!r}")
        out.append(v)
    return out


def _parse_sizes(items: list[str], task: Any) -> dict[str, object]:
    """``KEY=VALUE`` items -> sizes, each value converted to the key's type (``none``: no limit)."""
    valid = task.size_keys()
    sizes: dict[str, object] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--size must be KEY=VALUE, got {item!r}")
        if key not in valid:
            raise ValueError(
                f"--size {key}: task {task.name!r} has no such size; valid sizes: "
                f"{', '.join(valid) or 'none'} (attnopt train {task.name} --list-sizes)"
            )
        typ = valid[key][0]
        if val.lower() == "none" and None in valid[key][1:]:
            sizes[key] = None
            continue
        try:
            sizes[key] = typ(val)
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(typ, typ.__name__)
            raise ValueError(f"--size {key} must be {what}, got {val!r}") from None
    return sizes


def _list_sizes(task: Any) -> int:
    print(f"--size keys of {task.name} (KEY=VALUE; 'none' where a default is none = no limit):")
    rows = [(k, t.__name__, "task default" if q is None and f is None else f"{q}", f"{f}")
            for k, (t, q, f) in task.size_keys().items()]
    head = ("key", "type", "quick", "full")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, *rows]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _list() -> int:
    from attnopt.experiments import get_task, task_names

    for name in task_names():
        t = get_task(name)
        print(f"{name}: {t.paper}, {t.table}")
        if t.description:
            print(f"    {t.description}")
        print(
            f"    arms: {', '.join(t.arms)} (default {', '.join(t.default_arms)}); "
            f"lr grid: {', '.join(f'{x:g}' for x in t.lr_grid)}; data sets: {', '.join(t.datasets)}"
        )
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("lightning") is None:
        print(_NEEDS, file=sys.stderr)
        return 2
    if args.list:
        return _list()
    if args.task is None:
        print("error: give a TASK (attnopt train --list shows them)", file=sys.stderr)
        return 2
    from attnopt.experiments import get_task
    from attnopt.experiments._engine import TrainingInterrupted, existing_runs, plan_runs, run_task

    t0 = time.perf_counter()
    try:
        task = get_task(args.task)
        if args.list_sizes or "help" in args.size:
            return _list_sizes(task)
        sizes = _parse_sizes(args.size, task)
        for flag, val in (
            ("--seeds", args.seeds),
            ("--epochs", args.epochs),
            ("--batch-size", args.batch_size),
            ("--devices", args.devices),
        ):
            if val is not None and val < 1:
                raise ValueError(f"{flag} must be a positive integer, got {val}")
        if args.threads < 0:
            raise ValueError("--threads must be >= 0")
        if args.data_dir is not None and not Path(args.data_dir).is_dir():
            raise ValueError(f"--data-dir {args.data_dir} is not a folder")
        out = Path(args.out) if args.out else Path("attnopt-train") / task.name
        plan = dict(
            arms=args.arms.split(",") if args.arms else None,
            seeds=args.seeds,
            epochs=args.epochs,
            lrs=_parse_lrs(args.lr) if args.lr else None,
            batch_size=args.batch_size,
            quick=args.quick,
            dataset=args.dataset,
            data_dir=args.data_dir,
            out_dir=out,
            sizes=sizes,
        )
        if not (args.resume or args.overwrite):
            found = existing_runs(out, plan_runs(task, **plan))  # type: ignore[arg-type]
            if found:
                raise ValueError(
                    f"{out} already holds {len(found)} of these runs ({found[0].relative_to(out)}"
                    + (", ..." if len(found) > 1 else "") + "): add --resume to continue them "
                    "or --overwrite to start over"
                )
        records = run_task(
            task,
            **plan,  # type: ignore[arg-type]
            devices=args.devices,
            strategy=args.strategy,
            resume=args.resume,
            progress=not args.no_progress,
            threads=args.threads or None,
            log=print,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        where = f"{exc.run} keeps its last epoch checkpoint, " if isinstance(exc, TrainingInterrupted) else ""
        print(
            f"interrupted: {where}finished runs keep their record.json; "
            "run the same command with --resume to continue",
            file=sys.stderr,
        )
        return 130
    from attnopt.experiments._engine import is_global_zero

    if is_global_zero():
        n = len(records)
        print(f"{n} run{'' if n == 1 else 's'} in {time.perf_counter() - t0:.0f}s -> {out}/results.md")
        md = out / "results.md"
        if md.is_file():
            print(md.read_text(encoding="utf-8"))
    return 0
