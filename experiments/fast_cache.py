"""Which context entries the learned-gate presses, and KVzip's global top beside them, keep per layer and KV head
on the 8 RULER development examples of the regime runs (SmolLM2-135M, 1024-token contexts, the model's default
gate), r = 0.5 / 0.75 / 0.9.

Each press compresses the context as the pipeline does (``press_prefill``). Each entry a head holds is matched to its
position by the nearest key of the full cache's same head (``kvpress_prob.cache.kept_positions``; the same forward:
the distance is 0 up to rounding, and its largest value is recorded). Per press and ratio (``needle_summary``): the
needle (each answer's tokens in the context) kept whole in what fraction of (layer, KV head) pairs, in how many layers
by at least one head, the fraction of needle tokens kept, the spread of kept counts over heads, and the share of kept
entries among the last 10 % of the context; and ``kvzip_recall``, the share of ``topk_kvzip_global``'s kept entries
(same example and ratio) that the press keeps. Resumable: one JSON line per (example, press, ratio).

``regimes`` measures ``kvzip_recall`` alone (with the spread of counts and the last-10 % share) on the held-out
development contexts of all three regimes (``experiments.fast_profile.measuring_contexts``: 8 RULER examples, 4
prose windows, 6 recall windows, none of them the gate's or the profile's fitting contexts); ``regimes-table`` prints
it by regime and ratio.
  PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.fast_cache measure [OUT [PRESS ...]]
  PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.fast_cache regimes OUT PRESS ...
  PYTHONPATH=$PWD .venv/bin/python -m experiments.fast_cache table [OUT] > results/archive/dev/fast-cache/table.md"""

import json
import sys
from pathlib import Path

import pandas as pd
import torch

OUT = Path("results/archive/dev/fast-cache/survival.jsonl")
PRESSES = ["topk_gate_layers_recent25", "topk_gate_widest", "topk_gate_ragged", "topk_kvzip_global"]
RATIOS = [0.5, 0.75, 0.9]


def needle_summary(keep: torch.Tensor, spans: list[list[int]]) -> dict:
    """keep (L, H, n) bool; spans: the needles' positions (each non-empty). The needle kept whole in what fraction of
    (layer, head) pairs (``evaluation.metrics.survival``'s survival), in how many layers by at least one head, the
    fraction of needle tokens kept, the spread of kept counts over heads, the share of kept entries in the last 10 %."""
    from evaluation.metrics.survival import survival

    whole = [keep[..., span].all(-1) for span in spans]  # each (L, H)
    counts = keep.sum(-1).double()  # (L, H)
    return {"heads_whole": survival(keep, spans)["survival"],
            "layers_any_head": sum(float(w.any(-1).double().sum()) for w in whole) / len(spans),
            "needle_tokens_kept": sum(float(keep[..., span].double().mean()) for span in spans) / len(spans),
            **spread(keep), "count_cv": float(counts.std() / counts.mean())}


def spread(keep: torch.Tensor) -> dict:
    """keep (L, H, n) bool: the fewest and most entries a head keeps, and the share of kept entries in the last 10 %."""
    counts = keep.sum(-1)  # (L, H)
    n = keep.shape[-1]
    return {"count_min": int(counts.min()), "count_max": int(counts.max()),
            "last10_share": int(keep[..., int(0.9 * n):].sum()) / int(keep.sum())}


def append(out: Path, record: dict):
    """One JSON line more in ``out``, echoed to stderr."""
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), file=sys.stderr, flush=True)


def usage(command: str) -> str:
    """The module docstring's command line for ``command``."""
    return next(line.strip() for line in __doc__.splitlines() if f"fast_cache {command} " in line)


def finished(out: Path, key: str) -> set:
    """The (``key``, press, ratio) triples ``out`` already records; creates its folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        return set()
    return {(r[key], r["press"], r["compression_ratio"]) for r in map(json.loads, out.read_text().splitlines())}


def kept_sets(model, ids: torch.Tensor):
    """A function (press name, ratio) -> (keep (L, H, n) bool, largest matching distance) on the context ``ids``: the
    positions each head holds after the press compresses the context as the pipeline does."""
    from evaluation.engine import press_prefill
    from kvpress_prob.cache import kept_positions
    from kvpress_prob.names.registry import get_press

    with torch.no_grad():
        full = [layer.keys[0].clone() for layer in press_prefill(model, ids, None).layers]  # L x (H, n, d)

    def kept(name: str, ratio: float):
        with torch.no_grad():
            cache = press_prefill(model, ids, get_press(name, ratio))
        matched = [kept_positions(layer, keys) for layer, keys in zip(cache.layers, full)]
        return torch.stack([positions for positions, _ in matched]), max(d for _, d in matched)

    return kept


def regimes(out: Path, presses: list[str]):
    """``kvzip_recall`` of each press on each measuring context of the three regimes, at ``RATIOS`` (resumable)."""
    from evaluation.bench import common
    from experiments.fast_profile import measuring_contexts

    torch.set_num_threads(1)
    done = finished(out, "context")
    model, tokenizer = common.load(None)
    for regime, context, ids in measuring_contexts(model, tokenizer):
        todo = [(p, r) for p in presses for r in RATIOS if (context, p, r) not in done]
        if not todo:
            continue
        kept = kept_sets(model, ids)
        reference = {r: kept("topk_kvzip_global", r)[0] for r in sorted({r for _, r in todo})}
        for name, ratio in todo:
            keep, distance = kept(name, ratio)
            append(out, {"regime": regime, "context": context, "press": name, "compression_ratio": ratio,
                         "n_context": keep.shape[-1], "match_distance_max": distance,
                         "kvzip_recall": int((keep & reference[ratio]).sum()) / int(reference[ratio].sum()),
                         **spread(keep)})


def regimes_table(out: Path):
    from evaluation.report.tables import markdown_table

    df = pd.read_json(out, lines=True)
    recall = df.pivot_table(index="press", columns=["regime", "compression_ratio"], values="kvzip_recall")
    recall.columns = [f"{a} r={b:g}" for a, b in recall.columns]
    contexts = df.groupby("regime")["context"].nunique().to_dict()
    print("# Kept-set recall of KVzip's global top under each press's own allocation (development contexts held out "
          "from the gate's and the profile's fitting, SmolLM2-135M, "
          f"{df['n_context'].min()} to {df['n_context'].max()} tokens)\n")
    print(f"Contexts per regime: {contexts}. Recall = |kept & topk_kvzip_global's kept| / |topk_kvzip_global's "
          f"kept|, same context and ratio; largest key-matching distance {df['match_distance_max'].max():.2g}.\n")
    command = usage("regimes").replace("OUT PRESS ...", f"{out} {' '.join(sorted(df['press'].unique()))}")
    print(f"Command: `{command}`, then `... regimes-table {out}`.\n")
    print(markdown_table(recall.reset_index(), index=False, float_format="{:.3f}"))


def main(out: Path = OUT, presses: list[str] = PRESSES):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.bench import common
    from experiments.zip_gap import find, ruler_dev

    torch.set_num_threads(1)
    done = finished(out, "example_id")
    model, tokenizer = common.load(None)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    for row in ruler_dev(tokenizer):
        todo = [(p, r) for p in presses for r in RATIOS if (row["id"], p, r) not in done]
        if not todo:
            continue
        ids = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)["context_ids"]
        spans = [find(ids[0].tolist(), tokenizer.encode(" " + a, add_special_tokens=False)) or
                 find(ids[0].tolist(), tokenizer.encode(a, add_special_tokens=False)) for a in row["answer"]]
        spans = [s for s in spans if s]
        kept = kept_sets(model, ids)
        reference = {r: kept("topk_kvzip_global", r)[0] for r in sorted({r for _, r in todo})}
        for name, ratio in todo:
            keep, distance = kept(name, ratio)
            append(out, {"example_id": row["id"], "task": row["task"], "press": name, "compression_ratio": ratio,
                         "n_context": ids.shape[1], "needles": len(spans), "match_distance_max": distance,
                         "kvzip_recall": int((keep & reference[ratio]).sum()) / int(reference[ratio].sum()),
                         **needle_summary(keep, spans)})


def table(out: Path = OUT):
    from evaluation.report.tables import markdown_table

    df = pd.read_json(out, lines=True)
    if "kvzip_recall" not in df:
        df["kvzip_recall"] = float("nan")  # records written before the field
    out = df.groupby(["press", "compression_ratio"]).agg(
        examples=("example_id", "nunique"), heads_whole=("heads_whole", "mean"), layers_any_head=("layers_any_head", "mean"),
        needle_tokens_kept=("needle_tokens_kept", "mean"), count_min=("count_min", "min"), count_max=("count_max", "max"),
        count_cv=("count_cv", "mean"), last10_share=("last10_share", "mean"), kvzip_recall=("kvzip_recall", "mean"),
        match_distance_max=("match_distance_max", "max"))
    print("# What the learned-gate presses and KVzip's global top keep (RULER development, 8 examples, 30 layers x 3 KV "
          "heads)\n")
    print(f"Command: `{usage('measure')}`, then `... table`.\n")
    print(markdown_table(out.reset_index(), index=False, float_format="{:.3f}"))


if __name__ == "__main__":
    args = sys.argv[2:]
    if sys.argv[1] == "measure":
        main(Path(args[0]) if args else OUT, args[1:] or PRESSES)
    elif sys.argv[1] == "regimes":
        regimes(Path(args[0]), args[1:])
    elif sys.argv[1] == "regimes-table":
        regimes_table(Path(args[0]))
    else:
        table(Path(args[0]) if args else OUT)
