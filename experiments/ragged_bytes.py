"""Bytes held on the cache by the ragged presses beside snapkv and the padded prob_min_h, on the RULER development
contexts of results/archive/dev/round3-toprest-ruler-1024 (8 examples, SmolLM2-135M, 1024-token contexts), r = 0.5 / 0.75 /
0.9, seeds 0-2 for sampled presses, fp32 and bf16. Counts the storage of every tensor each layer holds (a view its
whole storage): K and V, and the correction bias (a padded layer's, read through the correction; a RaggedLayer's
own): ``kvpress_prob.cache.cache_held_bytes``. One shared prefill per context (evaluation.engine.Prefill).
Resumable: one JSON line per row; then the table of each press's bytes over snapkv's on the same example, ratio
and dtype, averaged over examples and seeds. For a
sampled press, `kv_x_expected` is the K+V of the draw's expected kept count (sum of its inclusion probabilities,
the sampler's ``stats["expected_kept"]``) over snapkv's: what its held K+V averages over seeds, without their noise
(the padded press holds its padding on top).
  PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.ragged_bytes measure
  PYTHONPATH=$PWD .venv/bin/python -m experiments.ragged_bytes table > results/archive/bytes/ragged-presses/table.txt"""

import json
import sys

import pandas as pd
from pathlib import Path

import torch

from evaluation.bench import common
from evaluation.bench.bytes.contexts import contexts
from evaluation.engine import Prefill
from kvpress_prob.cache import cache_held_bytes
from kvpress_prob.names.registry import get_press, is_sampling

FOLDER = Path("results/archive/dev/round3-toprest-ruler-1024")
OUT = Path("results/archive/bytes/ragged-presses/ruler-dev.jsonl")
PRESSES = ["snapkv", "prob_min_h", "prob_min_h_ragged", "cross_kvzip_block1_a75_toprest_ragged", "adakv_snapkv_ragged"]
RATIOS = [0.5, 0.75, 0.9]


def table():
    df = pd.read_json(OUT, lines=True)
    snap = df[df.press == "snapkv"].set_index(["example_id", "dtype", "compression_ratio"])[["kv_bytes"]]
    df = df.join(snap.rename(columns={"kv_bytes": "snapkv"}), on=["example_id", "dtype", "compression_ratio"])
    df["kv_x"] = df.kv_bytes / df.snapkv
    df["all_x"] = (df.kv_bytes + df.bias_bytes) / df.snapkv
    df["bias_x"] = df.bias_bytes / df.snapkv
    df["kv_x expected"] = df.expected_kv_bytes / df.snapkv if "expected_kv_bytes" in df else float("nan")
    seeds = df.groupby(["dtype", "press", "compression_ratio", "seed"])[["kv_x", "bias_x", "all_x"]].mean()
    out = df.groupby(["dtype", "press", "compression_ratio"]).agg(
        examples=("example_id", "nunique"), seeds=("seed", "nunique"), kv_x=("kv_x", "mean"), bias_x=("bias_x", "mean"),
        all_x=("all_x", "mean"), kv_x_expected=("kv_x expected", "mean"))
    out["kv_x seed max"] = seeds.groupby(["dtype", "press", "compression_ratio"]).kv_x.max()
    print(out.round(4).to_string())


def main():
    torch.set_num_threads(1)
    done = set()
    if OUT.exists():
        done = {(r["example_id"], r["dtype"], r["press"], r["compression_ratio"], r["seed"])
                for r in map(json.loads, OUT.read_text().splitlines())}
    model, tokenizer = common.load(None)
    ids = sorted({json.loads(line)["example_id"] for line in (FOLDER / "results.jsonl").read_text().splitlines()})
    found = contexts(FOLDER, model, tokenizer, set(ids))
    for dtype in ("float32", "bfloat16"):
        model.to(getattr(torch, dtype))
        for example in ids:
            configs = [(p, r, s) for p in PRESSES for r in RATIOS for s in (range(3) if is_sampling(p) else [0])
                       if (example, dtype, p, r, s) not in done]
            if not configs:
                continue
            context = found[example]
            built = [(p, r, s, get_press(p, r, seed=s) if is_sampling(p) else get_press(p, r)) for p, r, s in configs]
            shared = Prefill(model, context, [b[3] for b in built])
            for p, r, s, press in built:
                cache = shared.compress(press)
                kv, bias = cache_held_bytes(cache)
                row = dict(example_id=example, dtype=dtype, press=p, compression_ratio=r, seed=s,
                           n_context=context.shape[1], kv_bytes=kv, bias_bytes=bias)
                if "expected_kept" in press.stats:  # the draw's expectation: its kept count's, times one entry's bytes
                    kept = sum(map(sum, press.stats["kept"]))
                    row["expected_kv_bytes"] = press.stats["expected_kept"] * press.stats["bytes_kept"] / kept
                with OUT.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                del cache
            print(example, dtype, file=sys.stderr, flush=True)


if __name__ == "__main__":
    {"measure": main, "table": table}[sys.argv[1]]()
