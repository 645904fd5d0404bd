"""Speed and memory of compression while decoding, side by side in one run.

``python -m evaluation.bench decode-speed [--length 2048] [--target 512] [--interval 32] [--steps 128] [--repeats 3]``

A RULER context of ``--length`` tokens is prefilled once per repeat (full cache, untimed); each
variant then decodes the same ``--steps`` tokens one at a time from a copy of that cache, under its
decoding press (compression every ``--interval`` steps to ``--target`` entries per KV head, the
rounds' cost included in the timing). The variants run in a rotated order every repeat, so drift in
the machine's load hits all alike; medians over repeats are reported, and the corrected over
uncorrected throughput ratio is taken per repeat (the same kept sets: same seed) before its median.

- ``tok_per_s``: decode tokens per second of wall time (rounds included);
- ``peak_cache_bytes``: the largest keys + values + correction bias held by the cache after any
  step (the bias is what a corrected press stores beside the kept entries);
- ``bias_bytes``: the bias at the end.

Output: results/bench/speed/decoding/decode_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from kvpress import DecodingPress, KnormPress, SnapKVPress, TOVAPress
from transformers import DynamicCache

from evaluation.bench import common
from kvpress_prob.cache import cache_held_bytes
from kvpress_prob.names.decoding import get_decoding_press

OURS = ["decode_knorm_topk", "decode_tova_topk", "prob_decode_attn_priority", "prob_decode_attn_priority_nocorr",
        "prob_decode_tova_priority", "prob_decode_tova_priority_nocorr"]
KVPRESS = {"kvpress DecodingPress(KnormPress)": KnormPress, "kvpress DecodingPress(TOVAPress)": TOVAPress,
           "kvpress DecodingPress(SnapKVPress)": lambda: SnapKVPress(window_size=31)}
TWINS = [("prob_decode_attn_priority", "prob_decode_attn_priority_nocorr"),
         ("prob_decode_tova_priority", "prob_decode_tova_priority_nocorr")]
#: ours over kvpress's at the same target and interval
VERSUS = [("decode_knorm_topk", "kvpress DecodingPress(KnormPress)"),
          ("decode_tova_topk", "kvpress DecodingPress(TOVAPress)")]


def build(name: str, target: int, interval: int):
    if name == "full cache":
        return None
    if name in KVPRESS:
        return DecodingPress(base_press=KVPRESS[name](), compression_interval=interval, target_size=target,
                             hidden_states_buffer_size=interval)
    return get_decoding_press(name, target, interval)


@torch.no_grad()
def decode(model, cache, press, tokens: torch.Tensor, start: int) -> dict:
    times, peak = [], 0
    context = press(model) if press is not None else torch.no_grad()
    with context:
        for i, token in enumerate(tokens):
            with common.Stopwatch(model.device) as watch:
                model(input_ids=token.view(1, 1), past_key_values=cache,
                      position_ids=torch.tensor([[start + i]], device=token.device))
            times.append(watch.wall)
            kv, bias = cache_held_bytes(cache)  # a dense layer's correction bias, a ragged layer's own
            peak = max(peak, kv + bias)
    kv, bias = cache_held_bytes(cache)
    return {"seconds": sum(times), "tok_per_s": len(times) / sum(times), "median_step_ms": 1e3 * statistics.median(times),
            "peak_cache_bytes": peak, "final_kv_bytes": kv, "bias_bytes": bias,
            "rounds": (getattr(press, "stats", None) or {}).get("rounds")}


def summarise(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    summary = frame.groupby("variant", sort=False).agg(
        tok_per_s=("tok_per_s", "median"), tok_per_s_min=("tok_per_s", "min"), tok_per_s_max=("tok_per_s", "max"),
        median_step_ms=("median_step_ms", "median"), peak_cache_MiB=("peak_cache_bytes", lambda x: x.max() / 2**20),
        bias_KiB=("bias_bytes", lambda x: x.max() / 2**10), repeats=("tok_per_s", "size")).reset_index()
    full = summary.loc[summary.variant == "full cache", "tok_per_s"]
    if len(full):
        summary["over_full_cache"] = summary["tok_per_s"] / float(full.iloc[0])
    wide = frame.pivot(index="repeat", columns="variant", values="tok_per_s")
    ratios = []
    extra = [(name, name + "_nocorr") for name in frame.variant.unique()
             if name + "_nocorr" in set(frame.variant) and (name, name + "_nocorr") not in TWINS]
    versus = [(a, "kvpress DecodingPress(SnapKVPress)") for a, _ in TWINS + extra]
    for a, b in TWINS + extra + VERSUS + versus:
        if a in wide and b in wide:
            r = wide[a] / wide[b]
            ratios.append({"a": a, "b": b, "median_ratio": float(r.median()), "min_ratio": float(r.min()),
                           "max_ratio": float(r.max()), "repeats": int(r.size)})
    return summary, pd.DataFrame(ratios)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m evaluation.bench decode-speed", description=__doc__.split("\n")[0])
    for flag, default, text in (("--length", 2048, "prefilled context tokens"),
                                ("--target", 512, "entries per KV head after a round"),
                                ("--interval", 32, "decoding steps between rounds"),
                                ("--steps", 128, "timed decoding steps per variant"),
                                ("--repeats", 3, "repeats, the variants in a rotated order each time"),
                                ("--threads", 1, "torch.set_num_threads")):
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--model", default=None)
    parser.add_argument("--ours", nargs="*", default=[], metavar="NAME",
                        help="more decoding presses (kvpress_prob.decoding.press names), each with its _nocorr twin if it has "
                             "one: ratios corrected / uncorrected and over kvpress DecodingPress(SnapKVPress)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) / "speed" / "decoding"
    info = common.machine_info()
    model, tokenizer = common.load(args.model)
    ids = common.context_ids(tokenizer, args.length, device=model.device)
    tokens = torch.randint(100, 10000, (args.steps,), generator=torch.Generator().manual_seed(0)).to(model.device)
    from kvpress_prob.names.decoding import DECODING_PRESSES

    extra = [v for name in args.ours for v in (name, name + "_nocorr") if v in DECODING_PRESSES and v not in OURS]
    variants = ["full cache", *KVPRESS, *OURS, *dict.fromkeys(extra)]
    rows, start = [], time.time()
    for rep in range(args.repeats):
        prefilled = DynamicCache()
        with torch.no_grad():
            model.model(ids, past_key_values=prefilled)
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for name in order:
            result = decode(model, copy.deepcopy(prefilled), build(name, args.target, args.interval), tokens, args.length)
            rows.append({"repeat": rep, "variant": name, **result, "loadavg": (common.loadavg() or [None])[0]})
            print(f"[decode-speed] rep {rep} {name}: {result['tok_per_s']:.2f} tok/s, peak "
                  f"{result['peak_cache_bytes'] / 2**20:.1f} MiB", flush=True)
        del prefilled
        frame = pd.DataFrame(rows)
        summary, ratios = summarise(frame)
        info["elapsed_s"] = time.time() - start
        settings = vars(args) | {"variants": variants}
        common.write_json(out / "decode_speed.json", {"info": info, "settings": settings, "raw": frame,
                                                      "summary": summary, "ratios": ratios,
                                                      "status": f"{rep + 1}/{args.repeats} repeats"})
        text = (f"# Decode speed with compression every {args.interval} steps ({rep + 1}/{args.repeats} repeats)\n\n"
                f"Context {args.length} tokens (RULER, prefilled full), {args.steps} decoding steps per variant, target "
                f"{args.target} entries per KV head, {args.threads} thread(s), {info['processor']}; medians over repeats.\n"
                f"Command: `python -m evaluation.bench decode-speed --length {args.length} --target {args.target} "
                f"--interval {args.interval} --steps {args.steps} --repeats {args.repeats} --threads {args.threads}"
                + "".join(f" --ours {' '.join(args.ours)}" for _ in [0] if args.ours) + "`\n\n"
                + common.markdown_table(summary, index=False) + "\n\n## Throughput ratios (a / b, per repeat)\n\n"
                + common.markdown_table(ratios, index=False, float_format="{:.3f}") + "\n")
        common.write_markdown(out / "decode_speed.md", text)
    print(text)
