"""Long-generation check of the decoding presses and kvpress's sink loss.

``python -m experiments.decoding [--essays 3] [--split dev] [--prompt 256] [--generate 512] ...``

For each essay (the first ``--essays`` of the split, ``evaluation.tasks.prose.essays``): the prompt is
its first ``--prompt`` tokens; the full cache greedily generates ``--generate`` tokens (the
reference trajectory). Then under every decoding press (3 seeds for the presses that sample):

- ``agreement``: ``model.generate`` greedy under the press; the fraction of the generated
  positions whose token equals the full cache's, and ``first_divergence``, the first position
  where they differ (``--generate`` if never);
- ``kl``: teacher-forced along the full cache's trajectory, KL(full || press) per generated
  token, in nats; the press sees the trajectory in chunks of ``--interval`` tokens with a round
  after every chunk, which is the same schedule as one token per step with a round every
  ``--interval`` steps (a round runs after the forward that completes the interval);
- ``nll_increase``: the same teacher-forced pass along the essay's own next tokens, NLL(press) -
  NLL(full) per token (the streaming protocol of StreamingLLM / H2O / TOVA, one text).

Baselines: kvpress's ``DecodingPress`` over StreamingLLM, TOVA and K-norm at the same target and
interval (``kvpress_*``), and the streaming benchmark's (``snapkv``, ``h2o``, ...: kvpress's DecodingPress
built as in ``evaluation.tasks.streaming.presses``). A corrected press holds fewer entries, so that its bias fits
in the bytes of the target (``entries`` in each record; records before 2026-12-01 19:30 UTC held the target). ``sinks.md`` records which positions layer 0 keeps after 8 chunks of 32
at a target of 128, under kvpress's ``DecodingPress(StreamingLLMPress)`` and under ours (layer 0's
keys depend only on the token and its position, so they are matched against a full cache's).

Resumable: one JSON line per (essay, press, seed) in ``records.jsonl``, appended when done and
skipped when present; ``--shard i/n`` splits the essays. Output: results/bench/decoding/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from kvpress import DecodingPress, KnormPress, StreamingLLMPress, TOVAPress
from transformers import DynamicCache

from evaluation.bench import common
from evaluation.report.stats import mean_table, paired_table
from evaluation.store.results import parse_shard, shard
from evaluation.tasks.prose.essays import essay_ids, essays
from evaluation.tasks.streaming.drive import Schedule
from evaluation.tasks.streaming.presses import DETERMINISTIC, corrects, equal_memory_target
from kvpress_prob.names.decoding import get_decoding_press

KVPRESS = {"kvpress_streaming_llm": lambda: StreamingLLMPress(n_sink=4), "kvpress_tova": TOVAPress,
           "kvpress_knorm": KnormPress}
PRESSES = ["kvpress_streaming_llm", "kvpress_tova", "kvpress_knorm", "decode_streaming_llm", "decode_tova_topk",
           "decode_h2o_topk", "decode_attn_topk", "prob_decode_attn_priority", "prob_decode_attn_priority_nocorr",
           "prob_decode_h2o_priority", "prob_decode_attn_vase_nocorr"]
SEEDS = (0, 1, 2)
CHOSEN = "prob_decode_min_variance_priority_floor20"  # the decoding press chosen on the streaming dev split


def build(name: str, target: int, interval: int, window: int, seed: int, tokens_per_step: int,
          head_dim: int = 64, dtype: torch.dtype = torch.float32):
    """The press ``name`` for steps of ``tokens_per_step`` tokens with a round every ``interval`` tokens.

    ``kvpress_*``: kvpress's DecodingPress over the scorer, ``target`` entries. The streaming benchmark's
    baselines (``snapkv``, ``h2o``, ...) are built as there (``evaluation.tasks.streaming.presses``). Ours at
    ``target`` entries, with ``window`` recent entries kept; a corrected one (``prob_*`` but ``*_nocorr``)
    holds ``equal_memory_target`` entries, so that its bias fits in the bytes of ``target`` entries of
    ``head_dim`` keys and values in ``dtype`` (the streaming benchmark's accounting)."""
    steps = max(1, interval // tokens_per_step)
    if name in KVPRESS:
        return DecodingPress(base_press=KVPRESS[name](), compression_interval=steps, target_size=target,
                             hidden_states_buffer_size=steps)
    if name in DETERMINISTIC:
        schedule = Schedule(n=target + 2 * interval + 1, budget=target, chunk=min(tokens_per_step, interval),
                            interval=interval)
        return DETERMINISTIC[name](schedule, seed, head_dim, dtype)
    if corrects(name):
        bias = dtype if get_decoding_press(name, target, steps).bias_dtype == "keys" else torch.float32
        target = equal_memory_target(target, head_dim, dtype.itemsize, bias.itemsize)
    return get_decoding_press(name, target, steps, window=window, seed=seed)


def samples(name: str) -> bool:
    return name.startswith("prob_")


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, prompt: int, chunk: int, press=None) -> torch.Tensor:
    """Log-probabilities (T, V) of positions prompt-1 .. len-2 (predicting ids[prompt:]): the prompt is
    prefilled, then the rest is fed in chunks of ``chunk`` tokens at their true positions."""
    cache, out = DynamicCache(), []
    context = press(model) if press is not None else torch.no_grad()
    with context:
        logits = model(ids[:, :prompt], past_key_values=cache).logits[:, -1:]
        out.append(logits)
        for start in range(prompt, ids.shape[1] - 1, chunk):
            end = min(start + chunk, ids.shape[1] - 1)
            positions = torch.arange(start, end, device=ids.device)[None]
            out.append(model(ids[:, start:end], past_key_values=cache, position_ids=positions).logits)
    return torch.cat(out, dim=1)[0].float().log_softmax(-1)


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, n_tokens: int, press=None) -> list[int]:
    """Greedy ``model.generate`` of exactly ``n_tokens`` tokens, under ``press`` if given."""
    context = press(model) if press is not None else torch.no_grad()
    with context:
        out = model.generate(prompt_ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
    return out[0, prompt_ids.shape[1]:].tolist()


def kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per row of log-probabilities (T, V)."""
    return (reference.exp() * (reference - other)).sum(-1)


@torch.no_grad()
def layer0_positions(model, ids: torch.Tensor, press, prompt: int, chunk: int, chunks: int) -> list[list[int]]:
    """Positions layer 0 holds per KV head after ``chunks`` chunks of ``chunk`` tokens under ``press``."""
    full = DynamicCache()
    model.model(ids[:, : prompt + chunk * chunks], past_key_values=full)
    reference = full.layers[0].keys[0].double()
    cache = DynamicCache()
    with press(model):
        model.model(ids[:, :prompt], past_key_values=cache)
        for c in range(chunks):
            start = prompt + c * chunk
            model.model(ids[:, start:start + chunk], past_key_values=cache,
                        position_ids=torch.arange(start, start + chunk)[None])
    keys = cache.layers[0].keys[0].double()
    return [torch.cdist(keys[h], reference[h]).argmin(-1).tolist() for h in range(keys.shape[0])]


def sink_report(model, ids: torch.Tensor) -> tuple[str, list[dict]]:
    rows = []
    presses = {"kvpress DecodingPress(StreamingLLMPress(n_sink=4))": DecodingPress(
        base_press=StreamingLLMPress(n_sink=4), compression_interval=1, target_size=128, hidden_states_buffer_size=1),
        "decode_streaming_llm (ours)": get_decoding_press("decode_streaming_llm", 128, 1)}
    for name, press in presses.items():
        heads = layer0_positions(model, ids, press, 128, 32, 8)
        for h, positions in enumerate(heads):
            rows.append({"press": name, "kv_head": h, "kept": len(positions), "sinks_0_3_kept": all(p in positions for p in range(4)),
                         "min_position": min(positions), "in_positional_order": positions == sorted(positions),
                         "first_8_entries": positions[:8]})
    frame = pd.DataFrame(rows)
    text = ("# Layer 0 after 8 chunks of 32 at a target of 128 (prompt 128, a round after every chunk)\n\n"
            "Positions matched to a full cache's layer-0 keys (which depend only on token and position).\n\n"
            + common.markdown_table(frame, index=False) + "\n")
    return text, rows


@torch.no_grad()
def weight_report(model, ids: torch.Tensor, prompt: int, target: int, interval: int, window: int) -> tuple[str, list[dict]]:
    """The compounded weights a corrected press leaves: teacher-forced along ``ids`` in chunks of ``interval``
    under prob_decode_attn_priority (seed 0), then per layer and KV head the sum of the weights (which
    estimates the number of tokens seen), their median and maximum, and the share above 1."""
    from kvpress_prob.correction import bias as correction
    from kvpress_prob.presses.sampling import language_model

    press = get_decoding_press("prob_decode_attn_priority", target, 1, window=window)
    cache = DynamicCache()
    with press(model):
        model.model(ids[:, :prompt], past_key_values=cache)
        for start in range(prompt, ids.shape[1], interval):
            end = min(start + interval, ids.shape[1])
            model.model(ids[:, start:end], past_key_values=cache, position_ids=torch.arange(start, end)[None])
    rows = []
    for layer in language_model(model).layers:
        w = correction.bias_of(layer.self_attn, cache)[0].double().exp()  # (H_kv, S)
        for h in range(w.shape[0]):
            rows.append({"layer": layer.self_attn.layer_idx, "kv_head": h, "tokens_seen": ids.shape[1], "sum_w": float(w[h].sum()),
                         "median_w": float(w[h].median()), "max_w": float(w[h].max()), "share_above_1": float((w[h] > 1.0001).double().mean())})
    frame = pd.DataFrame(rows)
    text = (f"# Compounded weights after {press.stats['rounds'] // len(language_model(model).layers)} rounds per layer "
            f"(prob_decode_attn_priority, target {target}, {ids.shape[1]} tokens teacher-forced)\n\n"
            f"Sum of a head's weights over its {target} entries (estimates the tokens seen, {ids.shape[1]}): mean "
            f"{frame.sum_w.mean():.0f}, range {frame.sum_w.min():.0f}-{frame.sum_w.max():.0f} over {len(frame)} heads; "
            f"largest weight {frame.max_w.max():.0f}.\n\n" + common.markdown_table(frame, index=False) + "\n")
    return text, rows


def run_essay(model, tokenizer, path: Path, args, done: set, out: Path) -> None:
    ids = torch.tensor(essay_ids(tokenizer, path)[: args.prompt + args.generate + 1])[None]
    if ids.shape[1] < args.prompt + args.generate + 1:
        print(f"[decoding] {path.stem}: shorter than {args.prompt + args.generate + 1} tokens, skipped", flush=True)
        return
    prompt = ids[:, : args.prompt]
    reference_tokens = generate(model, prompt, args.generate)
    trajectory = torch.cat([prompt, torch.tensor([reference_tokens])], dim=1)  # (1, prompt + generate)
    full_traj = teacher_forced(model, trajectory, args.prompt, args.interval)
    full_text = teacher_forced(model, ids[:, : args.prompt + args.generate], args.prompt, args.interval)
    targets = ids[0, args.prompt: args.prompt + args.generate]
    config = model.config
    shape = dict(head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                 dtype=model.dtype)
    for name in args.presses:
        for seed in (SEEDS if samples(name) else (0,)):
            key = (path.stem, name, seed)
            if key in done:
                continue
            start = time.time()
            tokens = generate(model, prompt, args.generate,
                              build(name, args.target, args.interval, args.window, seed, 1, **shape))
            press = build(name, args.target, args.interval, args.window, seed, args.interval, **shape)
            traj = teacher_forced(model, trajectory, args.prompt, args.interval, press)
            text = teacher_forced(model, ids[:, : args.prompt + args.generate], args.prompt, args.interval,
                                  build(name, args.target, args.interval, args.window, seed, args.interval, **shape))
            same = [a == b for a, b in zip(tokens, reference_tokens)]
            record = {"essay": path.stem, "press": name, "seed": seed, "target": args.target,
                      "entries": press.target_size, "interval": args.interval,
                      "prompt": args.prompt, "generate": args.generate, "split": args.split,
                      "agreement": sum(same) / len(same),
                      "first_divergence": next((i for i, s in enumerate(same) if not s), len(same)),
                      "kl": float(kl(full_traj, traj).mean()),
                      "nll_increase": float((full_text - text).gather(-1, targets[:, None]).mean()),
                      "seconds": time.time() - start}
            with open(out / "records.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            done.add(key)
            print(f"[decoding] {path.stem} {name} seed={seed}: agreement {record['agreement']:.3f} kl {record['kl']:.4f} "
                  f"nll+ {record['nll_increase']:.4f} ({record['seconds']:.0f} s)", flush=True)


def report(out: Path) -> str:
    frame = pd.read_json(out / "records.jsonl", lines=True)
    split = ", ".join(sorted(frame["split"].unique()))
    lines = [f"# Long generation under decoding presses ({split} split, {frame['essay'].nunique()} essays)\n",
             f"Prompt {frame['prompt'].iloc[0]} tokens, {frame['generate'].iloc[0]} generated greedily, target "
             f"{frame['target'].iloc[0]} entries per head, a round every {frame['interval'].iloc[0]} tokens. Means over "
             f"essays of the seed-averaged value (3 seeds for presses that sample), 95 % t-intervals over essays.\n"]
    for value, label in [("agreement", "token agreement with the full cache (higher is better)"),
                         ("first_divergence", "first diverging position"),
                         ("kl", "KL(full || press) per token along the full cache's trajectory, nats"),
                         ("nll_increase", "NLL increase per token on the essay's text, nats")]:
        table = mean_table(frame, value, ["press"], unit="essay").sort_values("mean", ascending=value in ("kl", "nll_increase"))
        lines += [f"## {label}\n", common.markdown_table(table[["press", "mean", "lo", "hi", "n"]], index=False,
                                                        float_format="{:.4f}"), ""]
    pairs = [("prob_decode_attn_priority", "prob_decode_attn_priority_nocorr"), ("prob_decode_attn_priority", "decode_attn_topk"),
             ("prob_decode_h2o_priority", "decode_h2o_topk"), ("decode_tova_topk", "kvpress_tova"),
             ("decode_streaming_llm", "kvpress_streaming_llm"), ("prob_decode_attn_priority", "kvpress_tova"),
             ("prob_decode_attn_priority", "prob_decode_attn_vase_nocorr"),
             (CHOSEN, f"{CHOSEN}_nocorr"), (CHOSEN, "h2o"), (CHOSEN, "kvpress_tova")]
    rows = [paired_table(frame, value, "press", a, b, unit="essay").assign(value=value)
            for value in ("kl", "nll_increase", "agreement") for a, b in pairs]
    paired = pd.concat([r for r in rows if not r.empty], ignore_index=True)[["value", "a", "b", "mean_a", "mean_b", "mean", "lo", "hi", "n", "a_better"]]
    lines += ["## Paired differences (a - b) over essays\n",
              "Seed-averaged per essay, then paired; a_better counts the essays where a is lower (better for kl and "
              "nll_increase, worse for agreement).\n", common.markdown_table(paired, index=False, float_format="{:.4f}"), ""]
    per_essay = frame.groupby(["press", "essay"])[["kl", "nll_increase", "agreement"]].mean().unstack("essay")
    per_essay.columns = [f"{value} {essay}" for value, essay in per_essay.columns]
    lines += ["## Per essay (seed means)\n", common.markdown_table(per_essay, float_format="{:.4f}"), ""]
    text = "\n".join(lines)
    common.write_markdown(out / "decoding.md", text)
    common.write_json(out / "decoding.json", {"records": frame, "paired": paired})
    return text


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.decoding", description=__doc__.split("\n")[0])
    parser.add_argument("--essays", type=int, default=3, help="the first N essays of the split (default 3)")
    parser.add_argument("--split", default="dev", choices=["dev", "test"])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--generate", type=int, default=512)
    parser.add_argument("--target", type=int, default=128, help="entries per KV head after a round (default 128)")
    parser.add_argument("--interval", type=int, default=32, help="tokens between rounds (default 32)")
    parser.add_argument("--window", type=int, default=32, help="recent entries kept exactly by our presses (default 32)")
    parser.add_argument("--presses", nargs="+", default=PRESSES)
    parser.add_argument("--shard", default=None, help="i/n: this process's share of the essays")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--weights-only", action="store_true",
                        help="only weights.md: the compounded weights after teacher-forcing the first essay")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--model", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) / "decoding"
    out.mkdir(parents=True, exist_ok=True)
    if args.weights_only:
        model, tokenizer = common.load(args.model)
        path = essays(args.split)[0]
        ids = torch.tensor(essay_ids(tokenizer, path)[: args.prompt + args.generate])[None]
        text, rows = weight_report(model, ids, args.prompt, args.target, args.interval, args.window)
        common.write_markdown(out / "weights.md", f"Essay {path.stem} ({args.split} split).\n\n" + text)
        common.write_json(out / "weights.json", {"essay": path.stem, "rows": rows})
        print(text.split("\n\n")[0:2])
        return
    if not args.report_only:
        model, tokenizer = common.load(args.model)
        files = essays(args.split)[: args.essays]
        if args.shard is None:
            text, rows = sink_report(model, torch.tensor(essay_ids(tokenizer, files[0])[:128 + 256])[None])
            common.write_markdown(out / "sinks.md", text)
            common.write_json(out / "sinks.json", {"essay": files[0].stem, "rows": rows})
            print(text, flush=True)
        else:
            parse_shard(args.shard)
        done = set()
        if (out / "records.jsonl").exists():
            for line in (out / "records.jsonl").read_text().splitlines():
                r = json.loads(line)
                done.add((r["essay"], r["press"], r["seed"]))
        for path in shard(files, args.shard, key=lambda p: p.stem) if args.shard else files:
            run_essay(model, tokenizer, path, args, done, out)
    print(report(out))


if __name__ == "__main__":
    main()
