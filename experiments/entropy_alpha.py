"""Which exact fraction each layer and head gets under the entropy-set hybrids (docs/presses.md).

``python -m experiments.entropy_alpha --dataset ruler|prose ...`` prefills each context under each
press and ratio (the embedded model, no decoding) and writes, per press and ratio, the per-layer mean
alpha_h over heads and contexts and the share of (layer, head) pairs with alpha_h >= 0.9 (nearly top-k)
and <= 0.1 (nearly all sampled), read from the press's public ``stats["alpha"]``. RULER contexts are
the harness's (data seed, first examples of the tasks); prose contexts are the first ``--tokens`` tokens
of the prose development windows (docs/protocol.md, "Prose split"). Development splits only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evaluation.report.tables import markdown_table
from evaluation.store.results import write_atomic
from kvpress_prob import get_press, load_model

DEV_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3",
             "niah_multivalue", "niah_multiquery", "fwe"]


def ruler_contexts(model, tokenizer, length: int, n_examples: int, seed: int) -> dict[str, torch.Tensor]:
    """The harness's RULER contexts, tokenised as ``evaluation.engine.runner`` does (kvpress's pipeline), by example id."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.tasks.ruler.offline import generate_ruler

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    df = generate_ruler(tokenizer, length, n_examples, seed, DEV_TASKS)
    return {row["example_id"]: pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"],
                                               max_context_length=10**9)["context_ids"]
            for _, row in df.iterrows()}


def prose_contexts(tokenizer, tokens: int, max_per_essay: int | None) -> dict[str, torch.Tensor]:
    """The context (first ``tokens`` tokens) of each prose development window (``evaluation.tasks.prose.essays``,
    T = 256 scored tokens after it), by window."""
    from evaluation.tasks.prose.essays import windows

    return {f"{w.essay}-{w.index}": w.ids[:, :tokens]
            for w in windows(tokenizer, tokens, 256, "dev", max_per_essay)}


def alphas(model, ids: torch.Tensor, name: str, ratio: float) -> np.ndarray:
    """(L, H_kv) alpha_h of press ``name`` at ``ratio`` for one prefill of ``ids`` (1, n)."""
    press = get_press(name, ratio)
    with torch.no_grad(), press(model):
        model.model(input_ids=ids.to(model.device))
    return np.asarray(press.stats["alpha"], dtype=float).reshape(len(press.stats["kept"]), -1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.entropy_alpha", description=__doc__)
    parser.add_argument("--dataset", choices=["ruler", "prose"], required=True, help="which contexts (required)")
    parser.add_argument("--presses", nargs="+", required=True, help="entropy-set registry presses (required)")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75], help="(default: 0.5 0.75)")
    parser.add_argument("--tokens", type=int, default=1024, help="context length (default: 1024)")
    parser.add_argument("--n-examples", type=int, default=8, help="RULER examples (default: 8)")
    parser.add_argument("--data-seed", type=int, default=0, help="RULER data seed (default: 0)")
    parser.add_argument("--max-per-essay", type=int, default=None, help="prose: windows per essay (default: all)")
    parser.add_argument("--out", required=True, help="output folder (required)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(None)
    contexts = (ruler_contexts(model, tokenizer, args.tokens, args.n_examples, args.data_seed) if args.dataset == "ruler"
                else prose_contexts(tokenizer, args.tokens, args.max_per_essay))
    rows = []
    for context, ids in contexts.items():
        for name in args.presses:
            for ratio in args.ratios:
                a = alphas(model, ids, name, ratio)
                rows += [dict(context=context, press=name, ratio=ratio, layer=layer, head=head, alpha=float(a[layer, head]))
                         for layer in range(a.shape[0]) for head in range(a.shape[1])]
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "alpha.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    summary = df.groupby(["press", "ratio"]).alpha.agg(
        mean="mean", median="median", topk_like=lambda a: float((a >= 0.9).mean()),
        sampled_like=lambda a: float((a <= 0.1).mean())).reset_index()
    by_layer = df.groupby(["press", "ratio", "layer"]).alpha.mean().unstack("layer").round(2)
    by_layer.columns = [f"L{c}" for c in by_layer.columns]
    text = (f"# alpha_h per layer and head ({args.dataset}, {len(contexts)} contexts of {args.tokens} tokens)\n\n"
            f"Command: `python -m experiments.entropy_alpha {' '.join(argv or [])}`\n\n"
            "Share of (context, layer, head): topk_like = alpha >= 0.9, sampled_like = alpha <= 0.1.\n\n"
            + markdown_table(summary.round(3), index=False, float_format="{:.3f}") + "\n\nMean alpha per layer (over heads and contexts):\n\n"
            + markdown_table(by_layer.reset_index(), index=False) + "\n")
    write_atomic(out / "alpha.md", text)
    print(text)


if __name__ == "__main__":
    main()
