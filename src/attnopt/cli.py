"""The ``attnopt`` command: ``reproduce`` (the main job), ``bench``, ``analyze`` and ``train``."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _cmd_reproduce(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from attnopt.claims._runner import figures_text, run_claims, write_claims_report

    out = Path(args.out)
    t0 = time.perf_counter()
    print(f"attnopt reproduce ({'quick' if args.quick else 'full'}) -> {out}/report.md")
    print(f"{'claim':<58} {'verdict':<22} measured")

    def echo(run) -> None:  # type: ignore[no-untyped-def]
        name = f"{run.claim.paper}:{run.claim.key} {run.claim.title}"[:57]
        print(f"{name:<58} {run.verdict:<22} {figures_text(run, 3)}  [{run.seconds:.1f}s]", flush=True)

    try:
        runs = run_claims(quick=args.quick, out_dir=out, only=args.only, seed=args.seed, on_done=echo)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md, _ = write_claims_report(runs, out, quick=args.quick)
    errors = [r for r in runs if r.result is None]
    n_ok = sum(r.verdict == "reproduced" for r in runs)
    print(
        f"\n{n_ok}/{len(runs)} reproduced, {len(errors)} errors, "
        f"{time.perf_counter() - t0:.0f}s. Report: {md}"
    )
    for r in errors:
        print(f"\n--- {r.claim.id} raised:\n{r.error}", file=sys.stderr)
    return 1 if errors else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from attnopt.bench._harness import BenchContext
    from attnopt.bench._runner import run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    ctx = BenchContext(quick=args.quick, device=args.device, memory=not args.no_memory, repeat=args.repeat)
    print(f"attnopt bench: torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    try:
        run_bench(ctx, only=args.only, out=Path(args.out) if args.out else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnopt", description="Attention as optimization: reproduce, benchmark, analyze."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rep = sub.add_parser("reproduce", help="check every claim of the papers and write a report")
    rep.add_argument("--quick", action="store_true", help="reduced scale (a few minutes on a CPU)")
    rep.add_argument("--only", default=None, help="paper(s) or claim id(s), comma-separated")
    rep.add_argument("--out", default="attnopt-report", help="output directory")
    rep.add_argument("--seed", type=int, default=0)
    rep.set_defaults(func=_cmd_reproduce)

    ben = sub.add_parser("bench", help="time our mechanisms against their peers")
    ben.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ben.add_argument("--only", default=None, help="suite name(s), comma-separated")
    ben.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ben.add_argument("--repeat", type=int, default=5)
    ben.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ben.add_argument("--no-memory", action="store_true", help="skip peak-memory subprocesses")
    ben.add_argument("--out", default=None, help="write results to FILE.md or FILE.json")
    ben.set_defaults(func=_cmd_bench)

    _add_analyze(sub)
    _add_train(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from attnopt.cli_train import add_train_parser

    add_train_parser(sub)


def _add_analyze(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    try:
        from attnopt.cli_analyze import add_analyze_parser
    except ImportError:
        return
    add_analyze_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnopt`` console script."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = _build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
