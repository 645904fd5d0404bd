"""What a press keeps, per layer and head, on development contexts, and the per-head
statistics of the allocation design (kvpress_prob/samplers/mixture.py).

For each RULER dev example (data seed 0, 1024 tokens, the dev tasks; NIAH needles only) and each recall dev
window (the first ones of the recall split's order) and each press and ratio, the kept mask of every layer
and head is read from ``SamplingPress.evict`` (wrapped), then:
- RULER: the share of needle-value tokens kept (mean over heads), and the share of heads that keep every
  token of at least one needle occurrence ("whole"), per layer and overall;
- recall: the same for each cued sentence (its cue and scored tokens);
- per head, from the proposal pair the press saw (row 0 KVzip's pi, row 1 pi_min-h): the peak share c_h
  (row 0's mass in its own top k, k = floor((1 - r) n)) and the agreement a_h (row 1's mass on row 0's top k),
  whose medians and quartiles per regime say whether either separates RULER contexts from essay contexts.

    PYTHONPATH=$PWD python -m experiments.round2_cache --presses topk_kvzip_layers \\
        cross_kvzip_block8_a50_mix50_layers --ratios 0.5 0.75 --ruler 8 --recall 4 --out runs/round2-cache
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from kvpress import KVPressTextGenerationPipeline

from evaluation.engine import press_prefill
from evaluation.tasks.ruler.needles import needle_positions
from kvpress_prob import get_press, load_model
from kvpress_prob.samplers.mixture import peak_share
from kvpress_prob.presses.sampling import SamplingPress

TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3", "niah_multivalue",
         "niah_multiquery", "fwe"]


def kept_masks(model, ids, press):
    """{layer: (keep (H, n) bool, pi (H, [2,] n))} of one compressed prefill."""
    seen, original = {}, SamplingPress.evict

    def spy(self, cache, proposals):
        draw = original(self, cache, proposals)
        for i, module in enumerate(sorted(proposals, key=lambda m: m.layer_idx)):
            seen[module.layer_idx] = (draw.keep[i, 0].cpu(), proposals[module][0].double().cpu())
        return draw

    SamplingPress.evict = spy
    try:
        press_prefill(model, ids, press)
    finally:
        SamplingPress.evict = original
    return seen


def survival(masks, groups: list[list[int]]) -> dict:
    """Share of the groups' tokens kept (mean over layers and heads) and share of (layer, head) keeping a group whole."""
    tokens = sorted({p for g in groups for p in g})
    if not tokens:
        return {}
    per_layer, whole = [], []
    for layer in sorted(masks):
        keep = masks[layer][0]  # (H, n)
        per_layer.append(float(keep[:, tokens].float().mean()))
        whole.append(float(np.mean([any(bool(keep[h, g].all()) for g in groups if g) for h in range(keep.shape[0])])))
    return {"tokens": float(np.mean(per_layer)), "whole": float(np.mean(whole)),
            "tokens_by_layer": [round(x, 3) for x in per_layer], "whole_by_layer": [round(x, 3) for x in whole]}


def head_stats(masks, ratio: float) -> dict:
    """Per head: peak share of row 0 and agreement (row 1's mass on row 0's top k)."""
    peak, agree = [], []
    for layer in sorted(masks):
        pi = masks[layer][1]
        if pi.dim() != 3:
            continue
        n = pi.shape[-1]
        k = int((1 - ratio) * n + 1e-6)
        peak += peak_share(pi[:, 0], k).tolist()
        top = torch.zeros_like(pi[:, 0], dtype=torch.bool).scatter_(-1, pi[:, 0].topk(k, dim=-1).indices, True)
        agree += (pi[:, 1] * top).sum(-1).tolist()
    return {"peak": peak, "agree": agree}


def write(args, records):
    """cache.jsonl and cache.md of the records so far (written after every context)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["| press | r | RULER needle tokens kept | heads keeping a needle whole | recall cued tokens kept | "
             "heads keeping a cued sentence whole |", "|---|---|---|---|---|---|"]
    for name in args.presses:
        for ratio in args.ratios:
            rs = [r for r in records if r["press"] == name and r["ratio"] == ratio]
            ru = [r["needle"] for r in rs if r["regime"] == "ruler" and r["needle"]]
            rc = [v for r in rs if r["regime"] == "recall" for k, v in r.items() if k.startswith("cue") and v]
            lines.append(f"| {name} | {ratio:g} | {np.mean([x['tokens'] for x in ru]):.3f} | "
                         f"{np.mean([x['whole'] for x in ru]):.3f} | {np.mean([x['tokens'] for x in rc]):.3f} | "
                         f"{np.mean([x['whole'] for x in rc]):.3f} |")
    lines += ["", "Per-head statistics (median [quartiles] over heads and contexts):", "",
              "| press | r | regime | peak share c_h | agreement a_h |", "|---|---|---|---|---|"]
    for name in args.presses:
        for ratio in args.ratios:
            for regime in ("ruler", "recall"):
                rs = [r for r in records if r["press"] == name and r["ratio"] == ratio and r["regime"] == regime]
                peak = np.concatenate([r["peak"] for r in rs]) if rs and rs[0]["peak"] else np.array([])
                agree = np.concatenate([r["agree"] for r in rs]) if rs and rs[0]["agree"] else np.array([])
                if peak.size:
                    q = lambda x: f"{np.median(x):.3f} [{np.quantile(x, .25):.3f}, {np.quantile(x, .75):.3f}]"
                    lines.append(f"| {name} | {ratio:g} | {regime} | {q(peak)} | {q(agree)} |")
    (out / "cache.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presses", nargs="+", required=True)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ruler", type=int, default=8, help="RULER dev examples (one per task)")
    parser.add_argument("--recall", type=int, default=4, help="recall dev windows")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from evaluation.tasks.ruler.offline import generate_ruler
    from evaluation.tasks.recall import CUE_TOKENS, SCORED_TOKENS, SENTENCES
    from evaluation.tasks.recall.cues import order, windows

    torch.set_num_threads(1)
    model, tokenizer = load_model()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    contexts = []
    frame = generate_ruler(tokenizer, 1024, args.ruler, 0, tasks=TASKS)
    for _, row in frame.iterrows():
        if row["task"].startswith("niah"):
            ids = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)["context_ids"]
            groups = needle_positions(tokenizer, ids, list(row["answer"]))
            contexts.append(("ruler", row["example_id"], ids, {"needle": groups}))
    for w in order(windows(tokenizer, 1024, "dev", SENTENCES, CUE_TOKENS, SCORED_TOKENS), args.recall):
        cues = {f"cue{i}": [list(range(c.start, c.start + c.cue.shape[1] + c.targets.shape[0]))]
                for i, c in enumerate(w.cues)}
        contexts.append(("recall", w.window_id, w.ids, cues))
    records = []
    for regime, cid, ids, groups in contexts:
        for name in args.presses:
            for ratio in args.ratios:
                press = get_press(name, ratio, **({"seed": args.seed} if hasattr(get_press(name, 0.5), "seed") else {}))
                masks = kept_masks(model, ids, press)
                rec = {"regime": regime, "context": cid, "press": name, "ratio": ratio,
                       **{g: survival(masks, v) for g, v in groups.items()}, **head_stats(masks, ratio)}
                records.append(rec)
                print(regime, cid, name, ratio, {g: round(rec[g].get("tokens", -1), 3) for g in groups},
                      {g: round(rec[g].get("whole", -1), 3) for g in groups}, flush=True)
        write(args, records)
    print("\n".join(write(args, records)))


if __name__ == "__main__":
    main()
