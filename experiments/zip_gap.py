"""Why kvzip's mask beats its equal-memory twin: is the mask honest, and where does the gap come from.

1. Honesty. kvpress's ``KVzipPress`` masks entries (``masked_key_indices`` on the attention modules) and the
   harness turns them into the lowest bias (``Compressed.take``, ``masks_as_bias``). On one case of each
   benchmark, the logits of every later forward (RULER: question then answer; prose: the teacher-forced
   continuation; recall: a cue and its sentence) on kvzip's masked cache are compared with an explicit
   eviction of exactly the masked set (``topk_kvzip_padded``) and with a float64 dense reference whose
   attention weights are computed explicitly with the masked entries excluded
   (``kvpress_prob.testing.reference.dense_reference``).
2. Allocation. Per layer and head, the counts KVzip's global top keeps (``kvzip_keep``), the padding a
   real eviction of it needs, and which needle tokens (RULER) survive in which heads under each allocation.

Usage: ``python -m experiments.zip_gap --out runs/zip-diagnose`` (dev splits only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvpress_prob.testing.reference import dense_reference, float64_copy, masked_keep


@torch.no_grad()
def honesty(model, model64, context_ids: torch.Tensor, fed_ids: torch.Tensor, ratio: float) -> dict:
    """One case: kvzip's masked logits on ``fed_ids`` (the harness's bias path, ``masks_as_bias``) against an
    explicit eviction of its masked set and the float64 dense reference; the full cache as the scale."""
    from evaluation.engine import press_prefill, teacher_forced
    from evaluation.tasks.prose.measure import masks_as_bias
    from kvpress_prob.correction import bias as correction
    from kvpress_prob.presses import kvzip_scoring
    from kvpress_prob.presses.allocations import allocation_keep
    from kvpress_prob.presses.sampling import language_model
    from kvpress_prob.names.registry import get_press

    layers = language_model(model).layers
    n = context_ids.shape[1]
    cache = press_prefill(model, context_ids, get_press("kvzip", ratio))
    keep = masked_keep(layers, n)
    if not masks_as_bias(cache, layers):  # right after the press: a later prefill would drop kvpress's masks
        raise RuntimeError("kvzip left no mask on the modules")
    masked, _ = teacher_forced(model, cache, fed_ids, n)
    for layer in layers:
        correction.reset(layer.self_attn)
    del cache
    ragged = get_press("topk_kvzip_padded", ratio)
    cache = press_prefill(model, context_ids, ragged)
    evicted, _ = teacher_forced(model, cache, fed_ids, n)
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    same_set = ragged.kept == keep[:, 0].sum(-1).tolist() and bool(torch.equal(
        allocation_keep(raised(kvzip_scoring.SCORES.stored()[-1], ragged.n_sink), ratio, "padded"), keep))
    del cache
    full, _ = teacher_forced(model, press_prefill(model, context_ids, None), fed_ids, n)
    ref = dense_reference(model64, context_ids, fed_ids, keep)
    ref_full = dense_reference(model64, context_ids, fed_ids, None)

    def gap(a, b):
        return float((a.double() - b.double()).abs().max())

    return {"n": n, "T": fed_ids.shape[1], "ratio": ratio, "kept_fraction": float(keep.double().mean()),
            "our_scores_give_kvpress_set": same_set, "ragged_bytes_over_full": held / (2 * 4 * keep.numel() * model.config.head_dim),
            "masked_vs_evicted": gap(masked, evicted), "masked_vs_dense64": gap(masked, ref),
            "evicted_vs_dense64": gap(evicted, ref), "full_vs_dense64_full": gap(full, ref_full),
            "masked_vs_full (scale)": gap(masked, full)}


def raised(score_val: torch.Tensor, n_sink: int) -> torch.Tensor:
    """KVzip's scores (L, 1, H, n) as float32 with the sinks raised above every other, as kvpress ranks them."""
    scores = score_val.float().clone()
    scores[..., :n_sink] = scores.amax() + 1.0
    return scores


def kept_sets(scores: torch.Tensor, ratio: float) -> dict[str, torch.Tensor]:
    """The (L, 1, H, n) kept set of each allocation of KVzip's scores: kvpress's (ragged), ours over layers
    (``topk_kvzip_layers``), kvpress's count per head (``topk_kvzip_head``), and the two equal-memory ones."""
    from kvpress_prob.presses.kvzip import KVzipSampledPress
    from kvpress_prob.presses.allocations import allocation_keep

    L, _, H, n = scores.shape
    out = {a: allocation_keep(scores, ratio, a) for a in ("ragged", "widest", "ragged_fit")}
    counts = KVzipSampledPress(compression_ratio=ratio, layers=True).layer_counts(scores)
    per_head = n - int(n * ratio)
    for name, widths in (("layers", counts), ("head", [per_head] * L)):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        for layer, w in enumerate(widths):
            keep[layer].scatter_(-1, scores[layer].topk(w, dim=-1).indices, True)
        out[name] = keep
    return out


def span_survival(keep: torch.Tensor, positions: list[int]) -> dict:
    """For the token ``positions`` (a needle, a cued sentence): the fraction of (layer, head) pairs keeping all of
    them, the mean fraction kept, and per layer the number of heads keeping all of them."""
    sub = keep[:, 0][..., positions]  # (L, H, p)
    whole = sub.all(-1)
    return {"heads_all": round(float(whole.double().mean()), 3), "kept": round(float(sub.double().mean()), 3),
            "per_layer_heads_all": whole.sum(-1).tolist()}


def find(haystack: list[int], needle: list[int]) -> list[int]:
    """Positions of the first occurrence of ``needle`` in ``haystack`` (empty if absent)."""
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return list(range(i, i + len(needle)))
    return []


def allocation(scores: torch.Tensor, ratio: float) -> dict:
    """Counts per (layer, head) of KVzip's global top (sinks raised) and of each equal-memory allocation."""
    from kvpress_prob.presses.allocations import allocation_keep, widest_fit

    L, _, H, n = scores.shape
    rag = allocation_keep(scores, ratio, "padded")[:, 0].sum(-1)  # (L, H)
    k, widths = widest_fit(scores, ratio)
    mean = rag.sum(-1) // H
    return {"ratio": ratio, "kvzip_counts": rag.tolist(), "padding_ragged": float(rag.amax(-1).sum() * H / rag.sum()),
            "within_layer_max_over_mean": [round(float(m), 2) for m in (rag.amax(-1) / rag.double().mean(-1))],
            "layers_width": mean.clamp(min=1).tolist(), "widest_width": widths.tolist(),
            "widest_global_top_fraction": k / (L * H * n), "kvzip_global_top_fraction": float(rag.sum()) / (L * H * n)}


RULER_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3",
               "niah_multivalue", "niah_multiquery", "fwe"]  # the regime runs' RULER dev tasks


def ruler_dev(tokenizer) -> list[dict]:
    """The 8 RULER dev examples of the regime runs (data seed 0, 1024 tokens): context ids,
    question ids (the kvpress pipeline's preprocessing), answers, and the first answer's greedy tokens."""
    from evaluation.tasks import load_dataset_frame

    frame = load_dataset_frame("ruler", tokenizer, context_length=1024, n_examples=8, seed=0, tasks=RULER_TASKS)
    out = []
    for _, row in frame.iterrows():
        out.append({"id": row["example_id"], "context": row["context"], "question": row["question"],
                    "answer_prefix": row["answer_prefix"], "answer": list(row["answer"]), "task": row["task"]})
    return out


def cases(model, tokenizer) -> list[dict]:
    """One case per benchmark (dev): the first RULER example (question + its answer teacher-forced), the first
    prose window (256 tokens), the first recall window's first cue (cue + sentence)."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.tasks.prose.essays import windows as prose_windows
    from evaluation.tasks.prose.measure import order as prose_order
    from evaluation.tasks.recall import CUE_TOKENS, SCORED_TOKENS, SENTENCES
    from evaluation.tasks.recall.cues import order, windows as recall_windows

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    row = ruler_dev(tokenizer)[0]
    inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
    answer = tokenizer.encode(" " + row["answer"][0], add_special_tokens=False, return_tensors="pt")
    ruler = {"benchmark": "ruler", "id": row["id"], "context": inputs["context_ids"],
             "fed": torch.cat([inputs["questions_ids"][0], answer], dim=1)}
    w = prose_order(prose_windows(tokenizer, 1024, 256, "dev", max_per_essay=1))[0]
    prose = {"benchmark": "prose", "id": w.window_id, "context": w.ids[:, :1024], "fed": w.ids[:, 1024 : 1024 + 256]}
    r = order(recall_windows(tokenizer, 1024, "dev", SENTENCES, CUE_TOKENS, SCORED_TOKENS))[0]
    cue = r.cues[0]
    recall = {"benchmark": "recall", "id": f"{r.essay}:{r.index}", "context": r.ids,
              "fed": torch.cat([cue.cue, cue.targets[None, :-1]], dim=1)}
    return [ruler, prose, recall]


@torch.no_grad()
def scores_of(model, context_ids: torch.Tensor) -> torch.Tensor:
    """KVzip's reconstruction scores (L, 1, H, n) of one context, through our press (kvpress's scoring pass)."""
    from evaluation.engine import press_prefill
    from kvpress_prob.presses import kvzip_scoring
    from kvpress_prob.names.registry import get_press

    press = get_press("topk_kvzip_layers", 0.5)
    kvzip_scoring.clear_scores()
    press_prefill(model, context_ids, press)
    return raised(kvzip_scoring.SCORES.stored()[0], press.n_sink)


def survival_records(model, tokenizer, ratios, recall_windows: int, sink=None) -> list[dict]:
    """Per RULER dev example and recall dev window, per ratio: the allocation summary and, per allocation, the
    survival of each needle (RULER: each answer's tokens in the context) or cued sentence (recall)."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.tasks.recall import CUE_TOKENS, SCORED_TOKENS, SENTENCES
    from evaluation.tasks.recall.cues import order, windows as recall_windows_of

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    items = []
    for row in ruler_dev(tokenizer):
        ids = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)["context_ids"]
        spans = [find(ids[0].tolist(), tokenizer.encode(" " + a, add_special_tokens=False)) or
                 find(ids[0].tolist(), tokenizer.encode(a, add_special_tokens=False)) for a in row["answer"]]
        items.append(("ruler", row["id"], ids, [s for s in spans if s]))
    for w in order(recall_windows_of(tokenizer, 1024, "dev", SENTENCES, CUE_TOKENS, SCORED_TOKENS))[:recall_windows]:
        spans = [list(range(c.start, min(w.ids.shape[1], c.start + c.cue.shape[1] + c.targets.shape[0]))) for c in w.cues]
        items.append(("recall", f"{w.essay}:{w.index}", w.ids, spans))
    records = []
    for benchmark, example, ids, spans in items:
        scores = scores_of(model, ids)
        for ratio in ratios:
            sets = kept_sets(scores, ratio)
            record = {"benchmark": benchmark, "id": example, "spans": len(spans)} | allocation(scores, ratio)
            record["survival"] = {name: [span_survival(keep, span) for span in spans] for name, keep in sets.items()}
            print(json.dumps({k: v for k, v in record.items() if k in ("benchmark", "id", "ratio", "padding_ragged")}
                             | {name: [x["heads_all"] for x in v] for name, v in record["survival"].items()}), flush=True)
            records.append(record)
            if sink is not None:
                sink(record)
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--part", choices=["honesty", "survival"], required=True)
    parser.add_argument("--recall-windows", type=int, default=12)
    args = parser.parse_args(argv)
    from kvpress_prob.models import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    if args.part == "survival":  # written record by record (a cut run keeps what it finished)
        path = out / "survival.jsonl"
        path.write_text("")

        def sink(record):
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")

        survival_records(model, tokenizer, args.ratios, args.recall_windows, sink)
        return
    else:
        model64 = float64_copy(model)
        for case in cases(model, tokenizer):
            for ratio in args.ratios:
                record = {"benchmark": case["benchmark"], "id": case["id"]} | honesty(
                    model, model64, case["context"], case["fed"], ratio)
                print(json.dumps(record), flush=True)
                records.append(record)
    (out / f"{args.part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
