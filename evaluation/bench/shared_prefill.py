"""Speed-up of the runner's shared prefill over the naive per-configuration pipeline loop.

For each example, side by side: (a) the kvpress pipeline run once per configuration (a prefill
each), (b) one shared prefill whose layer hooks every configuration replays, then the pipeline's
decoding one configuration at a time, (c) the same shared prefill with every configuration decoded
in one batch (the runner's ``decode_batch``). The figures are total time (a) / (b) and (a) / (c),
with whether (b) and (c) give the pipeline's predictions.

    python -m evaluation.bench.shared_prefill [--context-length 2048] [--n-examples 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from kvpress import KVPressTextGenerationPipeline

from evaluation.datasets.ruler import generate_ruler
from evaluation.report import markdown_table
from evaluation.runner import Compressed, Config, SharedPrefill, generate_batch
from evaluation.store import write_atomic
from kvpress_prob import load_model

PRESSES = ["snapkv", "tova", "knorm", "streaming_llm", "prob_snapkv", "prob_knorm", "prob_min_h", "topk_min_h"]


def measure(model, tokenizer, rows, presses, ratio) -> list[dict]:
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    out = []
    for row in rows:
        configs = [Config(name, ratio, 0) for name in presses]
        start = time.perf_counter()
        naive = [pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                      press=cfg.build(), max_new_tokens=int(row["max_new_tokens"]))["answer"] for cfg in configs]
        t_naive = time.perf_counter() - start
        start = time.perf_counter()
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)
        shared = SharedPrefill(model, inputs["context_ids"])
        n = inputs["context_ids"].shape[1]
        ours = [pipe.generate_answer(inputs["questions_ids"][0], shared.compressed_cache(cfg.build()), n,
                                     int(row["max_new_tokens"])) for cfg in configs]
        t_shared = time.perf_counter() - start
        start = time.perf_counter()
        shared = SharedPrefill(model, inputs["context_ids"])
        items = []
        for cfg in configs:
            cache = shared.compressed_cache(cfg.build())
            items.append(Compressed.take(cache, shared.layers))
        batched = generate_batch(model, tokenizer, inputs["questions_ids"][0], items, n, int(row["max_new_tokens"]))
        t_batched = time.perf_counter() - start
        out.append(dict(example_id=row["example_id"], task=row["task"], context_tokens=n, configs=len(configs),
                        naive_s=t_naive, shared_s=t_shared, batched_s=t_batched, speedup=t_naive / t_shared,
                        speedup_batched=t_naive / t_batched, identical=naive == ours, identical_batched=naive == batched))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF id or path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--n-examples", type=int, default=3)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--presses", nargs="+", default=PRESSES, help="the configurations (8 by default)")
    p.add_argument("--quick", action="store_true", help="1 example at 1024 tokens")
    p.add_argument("--out", default="results/bench/shared_prefill")
    args = p.parse_args(argv)
    if args.quick:
        args.context_length, args.n_examples = 1024, 1
    model, tokenizer = load_model(args.model)
    df = generate_ruler(tokenizer, args.context_length, args.n_examples, seed=0,
                        tasks=["niah_single_1", "niah_single_2", "niah_multikey_1"])
    rows = measure(model, tokenizer, [r for _, r in df.iterrows()], args.presses, args.ratio)
    total_naive, total_shared = sum(r["naive_s"] for r in rows), sum(r["shared_s"] for r in rows)
    total_batched = sum(r["batched_s"] for r in rows)
    summary = dict(
        command="python -m evaluation.bench.shared_prefill " + " ".join(argv or []),
        machine=dict(platform=platform.platform(), cpus=torch.get_num_threads(), torch=torch.__version__),
        context_length=args.context_length, presses=args.presses, ratio=args.ratio, examples=rows,
        total_naive_s=total_naive, total_shared_s=total_shared, total_batched_s=total_batched,
        speedup=total_naive / total_shared, speedup_batched=total_naive / total_batched,
        all_identical=all(r["identical"] for r in rows), all_identical_batched=all(r["identical_batched"] for r in rows),
    )
    out = Path(args.out)
    write_atomic(out / "shared_prefill.json", json.dumps(summary, indent=2))
    import pandas as pd

    table = markdown_table(pd.DataFrame(rows), index=False, float_format="{:.2f}")
    md = (f"# Shared prefill vs the naive pipeline loop\n\n`{summary['command']}` · {len(args.presses)} "
          f"configurations at r = {args.ratio} · {summary['machine']}\n\n{table}\n"
          f"Total: naive {total_naive:.1f} s; shared prefill {total_shared:.1f} s, speed-up "
          f"{summary['speedup']:.2f}x, identical predictions: {summary['all_identical']}; shared prefill + batched "
          f"decoding {total_batched:.1f} s, **speed-up {summary['speedup_batched']:.2f}x**, identical predictions: "
          f"{summary['all_identical_batched']}.\n")
    write_atomic(out / "shared_prefill.md", md)
    print(md)


if __name__ == "__main__":
    main()
