"""The price of each press against snapkv's, side by side in one run: prefill time, prefill peak memory,
decode step time at the kept length, and the attention function the decode runs.

``python -m evaluation.bench price [--length 4096] [--ratio 0.5] [--repeats 3] [--presses ...] [--threads 1]``

One context (a RULER context cut to ``--length`` tokens), an untimed full-cache prefill and two decoding
steps first (the process's first ones pay one-time costs), then ``--repeats`` rounds. In each round every press
is prefilled once, in an order rotated every round (so drift in the machine's load hits every press
alike), under the press as the kvpress pipeline runs it (``engine.press_prefill``, eviction included),
timed, with its peak memory above what the process held before (``common.PeakMemory``: the resident
set's high-water mark on a CPU, ``max_memory_allocated`` on CUDA). KVzip's scores are forgotten before
every prefill, so each KVzip prefill pays its reconstruction pass on a fresh context. Then the round's
caches decode the same tokens in lockstep (step i of every press, in an order rotated every step), one
token a step after ``--warmup-steps`` untimed ones: each press's cache at its own kept length. The first
warm-up step of each press runs under the route spy (``route``): which attention function decoded it.

A ratio over snapkv's is taken within each round, then its median and range over rounds are reported.
Output (``--out``, default results/bench/price): ``price.jsonl``, the record, one row per press
(``evaluation.report.price`` reads it for the tables and ``kvprob presses NAME``); ``price-raw.jsonl``,
one row per press and round; ``price.md``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from evaluation.bench import common
from evaluation.bench.speed.measure import attention_modules, cache_bytes, masks_of, prefill, set_masks
from evaluation.bench.speed.route import route
from evaluation.engine.runner import REFERENCE
from kvpress_prob.cache import RaggedLayer
from kvpress_prob.correction import bias as correction

REFERENCE_PRESS = "snapkv"  # every ratio is over this press's, in the same round


def forget_kvzip_scores() -> None:
    """Empty KVzip's score cache: the next KVzip prefill pays its reconstruction pass (a fresh context)."""
    from kvpress_prob.presses.kvzip_scoring import clear_scores

    clear_scores()


def held_bytes(model, cache) -> tuple[int, int]:
    """(keys + values, correction bias) bytes held by ``cache``."""
    bias = 0
    for module in attention_modules(model):
        layer = cache.layers[module.layer_idx]  # a ragged layer holds its own bias
        b = layer.bias if isinstance(layer, RaggedLayer) else correction.bias_of(module, cache)
        bias += 0 if b is None else b.numel() * b.element_size()
    return cache_bytes(cache), bias


def kept_length(layer) -> float:
    """Entries a layer holds per KV head (a ragged layer: the mean of its heads' counts)."""
    return sum(layer.lengths) / len(layer.lengths) if isinstance(layer, RaggedLayer) else layer.keys.shape[2]


def _step(model, cache, token: torch.Tensor, position: int) -> None:
    model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[position]], device=token.device))


@torch.no_grad()
def run(model, ids: torch.Tensor, presses: list[str], ratio: float, repeats: int, decode_steps: int,
        warmup_steps: int, log=print) -> pd.DataFrame:
    """One row per press and round: prefill seconds and peak, kept length, held bytes, median decode step
    (ms) and the decode route (round 0's first warm-up step). ``presses`` must include ``REFERENCE_PRESS``."""
    if REFERENCE_PRESS not in presses:
        raise ValueError(f"presses must include {REFERENCE_PRESS!r}, whose figures every ratio divides by")
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1 (the route spy runs on the first), got {warmup_steps}")
    n = ids.shape[1]
    tokens = torch.randint(100, 10000, (warmup_steps + decode_steps,), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(model.device)
    warm = prefill(model, ids, REFERENCE, ratio).cache  # untimed: the process's first prefill and steps pay one-time costs
    for i, token in enumerate(tokens[:2]):
        _step(model, warm, token, n + i)
    del warm
    rows = []
    for rep in range(repeats):
        order = presses[rep % len(presses):] + presses[: rep % len(presses)]
        held = {}
        for name in order:
            forget_kvzip_scores()
            cache, press, watch, memory = prefill(model, ids, name, ratio, seed=rep)
            kv, bias = held_bytes(model, cache)
            held[name] = (cache, masks_of(model))
            set_masks(model, [None] * len(attention_modules(model)))
            rows.append({"press": name, "round": rep, "prefill_s": watch.wall, "prefill_cpu_s": watch.cpu,
                         "peak_bytes": memory.extra_bytes, "peak_method": memory.method,
                         "kept_length": statistics.mean(kept_length(layer) for layer in cache.layers),
                         "kv_bytes": kv, "bias_bytes": bias, "loadavg": (common.loadavg() or [None])[0]})
            del press
            log(f"[price] round {rep} {name}: prefill {watch.wall:.2f} s, peak +{memory.extra_bytes / 2**20:.0f} MiB")
        forget_kvzip_scores()
        times, routes = {name: [] for name in presses}, {}
        for i, token in enumerate(tokens):
            shift = i % len(presses)
            for name in presses[shift:] + presses[:shift]:
                cache, masks = held[name]
                set_masks(model, masks)
                if i == 0 and rep == 0:
                    routes[name] = route(model, lambda: _step(model, cache, token, n + i))
                    continue
                with common.Stopwatch(model.device) as watch:
                    _step(model, cache, token, n + i)
                if i >= warmup_steps:
                    times[name].append(watch.wall)
        set_masks(model, [None] * len(attention_modules(model)))
        for row in rows[-len(presses):]:
            row["decode_ms"] = 1e3 * statistics.median(times[row["press"]])
            row["decode_steps"] = len(times[row["press"]])
            row["decode_route"] = routes.get(row["press"])
        del held
        log(f"[price] round {rep}: decode " + ", ".join(f"{r['press']} {r['decode_ms']:.1f} ms" for r in rows[-len(presses):]))
    return pd.DataFrame(rows)


FIGURES = {"prefill": "prefill_s", "peak": "peak_bytes", "decode": "decode_ms"}


def summarise(raw: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """The record: per press, each figure's median over rounds and, per figure, its ratio over snapkv's
    taken within each round (``<figure>_over_snapkv``: median; ``_lo`` / ``_hi``: smallest and largest),
    the kept length, held bytes and decode route, with ``meta`` (model, device, n, ratio, command ...) on
    every row."""
    ref = raw[raw.press == REFERENCE_PRESS].set_index("round")
    rows = []
    for press, g in raw.groupby("press", sort=False):
        g = g.set_index("round")
        row = {"press": press, **meta, "rounds": len(g)}
        for short, column in FIGURES.items():
            ratio = g[column] / ref[column].reindex(g.index)
            row[column] = float(g[column].median())
            row[f"{short}_over_snapkv"] = float(ratio.median())
            row[f"{short}_over_snapkv_lo"], row[f"{short}_over_snapkv_hi"] = float(ratio.min()), float(ratio.max())
        row |= {"kept_length": float(g.kept_length.median()), "kv_bytes": int(g.kv_bytes.median()),
                "bias_bytes": int(g.bias_bytes.median()), "decode_route": g.decode_route.dropna().iloc[0],
                "peak_method": g.peak_method.iloc[0]}
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(record: pd.DataFrame) -> str:
    m = record.iloc[0]
    cell = lambda r, s: f"{r[f'{s}_over_snapkv']:.2f} [{r[f'{s}_over_snapkv_lo']:.2f}, {r[f'{s}_over_snapkv_hi']:.2f}]"  # noqa: E731
    table = pd.DataFrame({
        "press": record.press, "prefill time": [cell(r, "prefill") for _, r in record.iterrows()],
        "prefill peak": [cell(r, "peak") for _, r in record.iterrows()],
        "decode step": [cell(r, "decode") for _, r in record.iterrows()], "decode route": record.decode_route,
        "prefill s": record.prefill_s, "peak MiB": record.peak_bytes / 2**20, "step ms": record.decode_ms,
        "kept / layer": record.kept_length, "held MiB": (record.kv_bytes + record.bias_bytes) / 2**20,
    }).set_index("press")
    return "\n".join([
        f"# The price of each press over snapkv's ({m['device']}, n = {m['n']}, r = {m['ratio']:g})", "",
        f"Command: `{m['command']}`", "",
        f"Model {m['model']} ({m['dtype']}), {m['threads']} thread(s), {m['rounds']} rounds, presses interleaved "
        f"(order rotated every round; decode steps in lockstep, rotated every step), {m['decode_steps']} timed decode "
        f"steps per press and round. Ratios over snapkv's within each round: median [smallest, largest] over rounds. "
        f"Peak: {m['peak_method']}, above what the process held before the prefill. KVzip prefills score a fresh "
        f"context. Decode route: the attention function a spy saw decode the first step. Elapsed {m['elapsed_s']:.0f} s, "
        f"load average {m['loadavg']}.", "",
        common.markdown_table(table, float_format="{:.2f}"), ""])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation.bench price", description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096, help="context tokens (default 4096)")
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio (default 0.5)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, every press once in each (default 3)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per press and round (default 16)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps first (default 2; >= 1)")
    p.add_argument("--presses", nargs="+", default=None,
                   help="default: every press of the committed maximin tables (results/rule/*maximin*.csv); "
                        f"{REFERENCE_PRESS} is added when missing")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--model", default=None, help="HF id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/bench/price", help="output folder (default results/bench/price)")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    import sys

    from evaluation.report.price import table_presses
    from kvpress_prob.names.registry import get_press

    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    presses = args.presses or table_presses()
    presses = ([REFERENCE_PRESS] if REFERENCE_PRESS not in presses else []) + list(dict.fromkeys(presses))
    for name in presses:
        get_press(name, args.ratio)  # an unknown name fails before the model loads
    torch.set_num_threads(args.threads)
    start = time.time()
    model, tokenizer = common.load(args.model)
    ids = common.context_ids(tokenizer, args.length, device=model.device)
    info = common.machine_info()
    raw = run(model, ids, presses, args.ratio, args.repeats, args.decode_steps, args.warmup_steps)
    device = "cpu" if model.device.type == "cpu" else info["cuda_device"]
    meta = {"model": args.model or "embedded SmolLM2-135M-Instruct", "device": device, "dtype": str(model.dtype),
            "threads": torch.get_num_threads(), "n": args.length, "ratio": args.ratio, "decode_steps": args.decode_steps,
            "command": "python -m evaluation.bench price " + shlex.join(argv), "elapsed_s": time.time() - start,
            "loadavg": common.loadavg()}
    record = summarise(raw, meta)
    out = Path(args.out)
    common.write_markdown(out / "price-raw.jsonl", raw.to_json(orient="records", lines=True))
    common.write_markdown(out / "price.jsonl", record.to_json(orient="records", lines=True))
    common.write_markdown(out / "price.md", markdown(record))
    print(markdown(record))
    return record

