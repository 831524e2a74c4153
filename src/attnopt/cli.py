"""The ``attnopt`` command: ``reproduce`` (the main job), ``bench``, ``analyze`` and ``train``.

A command whose optional packages are missing says which extra to install in one line
(exit code 2); ``reproduce`` runs every claim it can and marks the others ``skipped``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _use_agg() -> None:
    try:
        import matplotlib
    except ImportError:  # claims that draw are skipped with the install command
        return
    matplotlib.use("Agg")


def _cmd_reproduce(args: argparse.Namespace) -> int:
    _use_agg()
    from attnopt.claims._runner import REPRODUCE_INSTALL, figures_text, run_claims, write_claims_report
    from attnopt.report import format_duration

    if args.list:
        return _list_claims(args.only)
    out = Path(args.out)
    t0 = time.perf_counter()
    scale = args.scale or ("quick" if args.quick else "full")
    if args.quick and args.scale not in (None, "quick"):
        print(f"error: --quick contradicts --scale {args.scale}", file=sys.stderr)
        return 2
    print(f"attnopt reproduce ({scale}) -> {out}/report.md")
    print(f"{'claim':<58} {'verdict':<22} measured")

    def echo(run) -> None:  # type: ignore[no-untyped-def]
        name = f"{run.claim.paper}:{run.claim.key} {run.claim.title}"[:57]
        took = format_duration(run.seconds)
        print(f"{name:<58} {run.verdict:<22} {figures_text(run, 3)}  [{took}]", flush=True)

    try:
        runs = run_claims(quick=scale == "quick", out_dir=out, only=args.only, seed=args.seed, on_done=echo,
                          scale=scale, resume=args.resume)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md, _ = write_claims_report(runs, out, quick=scale == "quick", scale=scale,
                                wall_s=time.perf_counter() - t0)
    errors = [r for r in runs if r.verdict == "error"]
    skipped = [r for r in runs if r.verdict == "skipped"]
    n_ok = sum(r.verdict == "reproduced" for r in runs)
    n_inc = sum(r.verdict == "inconclusive" for r in runs)
    print(
        f"\n{n_ok}/{len(runs)} reproduced, {n_inc} inconclusive, {len(skipped)} skipped, "
        f"{len(errors)} errors, {time.perf_counter() - t0:.0f}s. Report: {md}"
    )
    if skipped:
        print(f"{len(skipped)} claims skipped for missing optional packages: {REPRODUCE_INSTALL}")
    for r in errors:
        print(f"\n--- {r.claim.id} raised:\n{r.error}", file=sys.stderr)
    return 1 if errors else 0


def _list_claims(only: str | None) -> int:
    from attnopt.claims._registry import all_claims
    from attnopt.claims._runner import missing_requirements

    try:
        claims = all_claims(only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'claim':<40} {'reference':<28} {'needs':<24} title")
    for c in claims:
        needs = ",".join(c.requires) or "-"
        if missing_requirements(c) is not None:
            needs += " (missing)"
        print(f"{c.id:<40} {c.reference[:27]:<28} {needs:<24} {c.title}")
    print(f"\n{len(claims)} claims. Extras: pip install 'attnopt[EXTRA]'; all of them: pip install "
          "'attnopt[reproduce]'")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from attnopt.bench._harness import BenchContext
    from attnopt.bench._runner import run_bench

    if args.threads < 0:
        print("error: --threads must be >= 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if args.against is not None:
        return _cmd_bench_against(args)
    ctx = BenchContext(quick=args.quick, device=args.device, memory=not args.no_memory, repeat=args.repeat,
                       threads=args.threads or None)
    print(f"attnopt bench: torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    try:
        run_bench(ctx, only=args.only, out=Path(args.out) if args.out else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench_against(args: argparse.Namespace) -> int:
    """``attnopt bench --against PATH``: paired A/B timing (:mod:`attnopt.bench.paired`)."""
    from attnopt.bench.paired import run_paired

    if args.device != "cpu":
        print("error: --against times CPU rows (one thread per worker); drop --device", file=sys.stderr)
        return 2
    try:
        suites = tuple(args.only.split(",")) if args.only else ("small_n", "train_step")
        sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else None
        rows = tuple(x.strip() for x in args.rows.split(",")) if args.rows else ()
        print(f"attnopt bench --against {args.against}: paired rounds, this ÷ other "
              "(median of per-round ratios)")
        run_paired(Path(args.against), suites=suites, sizes=sizes, rounds=args.rounds, rows=rows,
                   out=Path(args.out) if args.out else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def bench_suite_lines() -> list[str]:
    """``name  first docstring line`` for every bench suite (imports the suite modules)."""
    from attnopt.bench._harness import all_suites

    suites = all_suites()
    width = max(map(len, suites))
    lines = []
    for name, fn in sorted(suites.items()):
        doc = fn.__doc__ or sys.modules[fn.__module__].__doc__ or ""
        lines.append(f"  {name:<{width}}  {(doc.strip().splitlines() or [''])[0]}".rstrip())
    return lines


class _BenchHelp(argparse.Action):
    """``attnopt bench --help``: the options, then the suites (imported only when asked)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object,  # noqa: ARG002
                 option_string: str | None = None) -> None:  # noqa: ARG002
        parser.epilog = "suites (--only NAME[,NAME]):\n" + "\n".join(bench_suite_lines())
        parser.print_help()
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    from attnopt import __version__

    parser = argparse.ArgumentParser(
        prog="attnopt", description="Attention as optimization: reproduce, benchmark, analyze."
    )
    parser.add_argument("--version", action="version", version=f"attnopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    rep = sub.add_parser("reproduce", help="check every claim of the papers and write a report")
    rep.add_argument("--quick", action="store_true",
                     help="reduced scale (a few minutes on a CPU); the same as --scale quick")
    rep.add_argument("--scale", choices=("quick", "standard", "full"), default=None,
                     help="quick: minutes, may answer 'inconclusive'; standard: the trained claims to "
                          "convergence with more seeds (hours on a CPU); full: the paper's scale "
                          "(default: full, or quick with --quick)")
    rep.add_argument("--resume", action="store_true",
                     help="continue an interrupted run in --out: finished training runs are kept")
    rep.add_argument("--only", default=None, help="paper(s) or claim id(s), comma-separated")
    rep.add_argument("--out", default="attnopt-report", help="output directory")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--list", action="store_true",
                     help="list every claim with its paper, equation and the extras it needs")
    rep.set_defaults(func=_cmd_reproduce)

    ben = sub.add_parser("bench", help="time our mechanisms against their peers", add_help=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    ben.add_argument("-h", "--help", action=_BenchHelp, nargs=0, help="show this help (and the suites)")
    ben.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ben.add_argument("--only", default=None, help="suite name(s), comma-separated (listed below)")
    ben.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ben.add_argument("--repeat", type=int, default=5)
    ben.add_argument("--threads", type=int, default=0,
                     help="torch threads, and the most any row uses (default: torch's)")
    ben.add_argument("--no-memory", action="store_true", help="skip peak-memory subprocesses")
    ben.add_argument("--out", default=None, help="write results to FILE.md or FILE.json")
    ben.add_argument("--against", default=None, metavar="PATH",
                     help="paired A/B against another attnopt checkout (e.g. a git worktree of the old "
                          "commit): small_n and train_step rows (or --only) in both trees, alternately, "
                          "one thread each; prints this ÷ other per row (median of per-round ratios)")
    ben.add_argument("--rounds", type=int, default=10, help="with --against: rounds per case")
    ben.add_argument("--sizes", default=None,
                     help="with --against: sequence lengths, comma-separated (default small_n 64,256,1024; "
                          "train_step 128)")
    ben.add_argument("--rows", default=None,
                     help="with --against: only these rows (comma-separated exact names; the sdpa / softmax "
                          "control is always kept)")
    ben.set_defaults(func=_cmd_bench)

    _add_analyze(sub)
    _add_train(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:
    from attnopt.cli_train import add_train_parser

    add_train_parser(sub)


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    from attnopt.cli_analyze import add_analyze_parser  # stdlib only at import time

    add_analyze_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnopt`` console script."""
    from attnopt._extras import as_missing_extra

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ImportError as exc:  # an optional package: one line naming the extra, no traceback
        missing = as_missing_extra(exc, f"attnopt {args.command}")
        if missing is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
