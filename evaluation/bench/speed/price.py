"""The price of each press against snapkv's, side by side in one run: prefill time, prefill peak memory,
decode step time at the kept length, the attention function the decode runs, and where a prefill's time goes.

``python -m evaluation.bench price [--length 4096] [--ratio 0.5] [--repeats 3] [--presses ...] [--threads 1]``

One context (a RULER context cut to ``--length`` tokens), ``--repeats`` rounds. In each round every press is
measured once, in an order rotated every round (so drift in the machine's load hits every press alike), each
in a fresh process (``evaluation.bench.speed.price_one``) with ``MALLOC_MMAP_THRESHOLD_`` = 65536, so that
its peak does not depend on what ran before it: the process pays its one-time costs on a short untimed
prefill, then prefills under the press as the kvpress pipeline runs it (``engine.press_prefill``, eviction
included), timed, with its peak memory above what the process held before (``common.PeakMemory``: the
resident set's high-water mark on a CPU, ``max_memory_allocated`` on CUDA) and its parts (plain prefill,
KVzip's reconstruction forwards, scoring, proposal, allocation: ``evaluation.bench.speed.parts``), then
decodes ``--warmup-steps`` untimed and ``--decode-steps`` timed tokens on its cache at its kept length (the
first warm-up step under the route spy, ``route``: which attention function decoded it). Every KVzip prefill
scores a fresh context (a new process holds no scores). The load average before and after each prefill is
recorded: on a shared machine another process may hold a core. ``kvpress_kvzip`` (``price_one.ANCHORS``) is
kvpress's own ``KVzipPress`` as shipped.

A ratio over snapkv's is taken within each round, then its median and range over rounds are reported.
Output (``--out``, default results/bench/price): ``price.jsonl``, the record, one row per press
(``evaluation.report.price`` reads it for the tables and ``kvprob presses NAME``); ``price-raw.jsonl``,
one row per press and round; ``price.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from evaluation.bench import common
from evaluation.bench.speed.parts import PARTS
from evaluation.bench.speed.price_one import ANCHORS, price_row

REFERENCE_PRESS = "snapkv"  # every ratio is over this press's, in the same round
MMAP_THRESHOLD = 65536  # bytes: glibc maps larger blocks, and unmaps them when freed


def measure_in_child(spec: dict) -> dict:
    """``price_one.measure(spec)`` in a fresh process, large blocks unmapped when freed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS=str(spec["threads"]))
    done = subprocess.run([sys.executable, "-m", "evaluation.bench.speed.price_one", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"price of {spec['name']} (round {spec['round']}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_here(model, ids, presses: list[str], ratio: float, repeats: int, decode_steps: int, warmup_steps: int,
             log=print) -> pd.DataFrame:
    """``run`` in this process, on a loaded model (``kvprob gpu-check``: CUDA's peak is the allocator's, which a
    previous prefill does not inflate)."""
    rows = []
    for rep in range(repeats):
        for name in presses[rep % len(presses):] + presses[: rep % len(presses)]:
            rows.append(price_row(model, ids, name, rep, ratio, decode_steps, warmup_steps))
            log(f"[price] round {rep} {name}: prefill {rows[-1]['prefill_s']:.2f} s")
    return pd.DataFrame(rows)


def run(presses: list[str], repeats: int, log=print, **spec) -> pd.DataFrame:
    """One row per press and round (``price_one.measure``'s). ``presses`` must include ``REFERENCE_PRESS``;
    ``spec``: ratio, length, model, threads, decode_steps, warmup_steps, dtype."""
    if REFERENCE_PRESS not in presses:
        raise ValueError(f"presses must include {REFERENCE_PRESS!r}, whose figures every ratio divides by")
    if spec["warmup_steps"] < 1:
        raise ValueError(f"warmup_steps must be >= 1 (the route spy runs on the first), got {spec['warmup_steps']}")
    rows = []
    for rep in range(repeats):
        for name in presses[rep % len(presses):] + presses[: rep % len(presses)]:
            row = measure_in_child({"name": name, "round": rep, **spec})
            rows.append(row)
            log(f"[price] round {rep} {name}: prefill {row['prefill_s']:.2f} s, peak +{row['peak_bytes'] / 2**20:.0f} "
                f"MiB, decode {row['decode_ms']:.1f} ms, load {row['loadavg_before']} -> {row['loadavg_after']}")
    return pd.DataFrame(rows)


FIGURES = {"prefill": "prefill_s", "peak": "peak_bytes", "decode": "decode_ms"}


def summarise(raw: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """The record: per press, each figure's median over rounds and, per figure, its ratio over snapkv's
    taken within each round (``<figure>_over_snapkv``: median; ``_lo`` / ``_hi``: smallest and largest),
    the median seconds of each part of the prefill (``<part>_s``, ``parts.PARTS``) where the rows have them, the
    peak's spread over rounds (``peak_spread``: largest over smallest), the kept length, held bytes and decode
    route, with ``meta`` (model, device, n, ratio, command ...) on every row."""
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
        row |= {f"{part}_s": float(g[f"{part}_s"].median()) for part in PARTS if f"{part}_s" in g}
        row |= {"peak_spread": float(g.peak_bytes.max() / g.peak_bytes.min()) if g.peak_bytes.min() > 0 else None,
                "kept_length": float(g.kept_length.median()), "kv_bytes": int(g.kv_bytes.median()),
                "bias_bytes": int(g.bias_bytes.median()), "decode_route": g.decode_route.dropna().iloc[0],
                "peak_method": g.peak_method.iloc[0]}
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(record: pd.DataFrame, raw: pd.DataFrame | None = None) -> str:
    m = record.iloc[0]
    cell = lambda r, s: f"{r[f'{s}_over_snapkv']:.2f} [{r[f'{s}_over_snapkv_lo']:.2f}, {r[f'{s}_over_snapkv_hi']:.2f}]"  # noqa: E731
    table = pd.DataFrame({
        "press": record.press, "prefill time": [cell(r, "prefill") for _, r in record.iterrows()],
        "prefill peak": [cell(r, "peak") for _, r in record.iterrows()],
        "decode step": [cell(r, "decode") for _, r in record.iterrows()], "decode route": record.decode_route,
        "prefill s": record.prefill_s, "peak MiB": record.peak_bytes / 2**20, "peak spread": record.peak_spread,
        "step ms": record.decode_ms, "kept / layer": record.kept_length,
        "held MiB": (record.kv_bytes + record.bias_bytes) / 2**20,
    }).set_index("press")
    lines = [
        f"# The price of each press over snapkv's ({m['device']}, n = {m['n']}, r = {m['ratio']:g})", "",
        f"Command: `{m['command']}`", "",
        f"Model {m['model']} ({m['dtype']}), {m['threads']} thread(s), {m['rounds']} rounds, presses interleaved "
        f"(order rotated every round), each press and round in a fresh process (MALLOC_MMAP_THRESHOLD_ = "
        f"{MMAP_THRESHOLD}), {m['decode_steps']} timed decode steps per press and round. Ratios over snapkv's within "
        f"each round: median [smallest, largest] over rounds. Peak: {m['peak_method']}, above what the process held "
        f"before the prefill; peak spread: its largest over its smallest round. KVzip prefills score a fresh "
        f"context. Decode route: the attention function a spy saw decode the first step. Elapsed {m['elapsed_s']:.0f} s, "
        f"load average {m['loadavg_start']} at the start, {m['loadavg']} at the end (2 cores; a load above 1 means "
        f"another process held a core for part of the run).", "",
        common.markdown_table(table, float_format="{:.2f}"), ""]
    parts = [f"{part}_s" for part in PARTS if f"{part}_s" in record]
    if parts:
        seconds = record.set_index("press")[["prefill_s", *parts]].rename(columns=lambda c: c[:-2].replace("_", " ") + " s")
        over = seconds.div(float(record.set_index("press").loc[REFERENCE_PRESS, "prefill_s"]))
        lines += ["Where the prefill's time goes (median seconds over rounds; in parentheses, over snapkv's whole "
                  "prefill): plain prefill = the prefill's forward, less a proposal computed in its hooks; "
                  "reconstruction = KVzip's later forwards, less its scoring and its fused attention (the reconstruction's "
                  "attention with KVzip's score from the same logits); allocation = KVzip's allocation and "
                  "eviction after the scoring; other = the rest (kvpress's tokenizer and chunking).", "",
                  common.markdown_table(seconds.round(2).astype(str) + " (" + over.round(2).astype(str) + ")"), ""]
    if raw is not None and "loadavg_before" in raw:
        loads = raw[["round", "press", "prefill_s", "peak_bytes", "loadavg_before", "loadavg_after"]].copy()
        loads["peak_bytes"] = loads.peak_bytes / 2**20
        lines += ["Every press and round, in the order run, with the 1-minute load average before and after its "
                  "prefill:", "", common.markdown_table(loads.rename(columns={"peak_bytes": "peak MiB"}).set_index("round"),
                                                        float_format="{:.2f}"), ""]
    return "\n".join(lines)


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
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype (default: float32 on a CPU, bfloat16 on CUDA)")
    p.add_argument("--out", default="results/bench/price", help="output folder (default results/bench/price)")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    from evaluation.report.price import table_presses
    from kvpress_prob.names.registry import get_press

    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    presses = args.presses or table_presses()
    presses = ([REFERENCE_PRESS] if REFERENCE_PRESS not in presses else []) + list(dict.fromkeys(presses))
    for name in presses:
        if name not in ANCHORS:
            get_press(name, args.ratio)  # an unknown name fails before any process starts
    start, load_start = time.time(), common.loadavg()
    raw = run(presses, args.repeats, ratio=args.ratio, length=args.length, model=args.model, threads=args.threads,
              decode_steps=args.decode_steps, warmup_steps=args.warmup_steps, dtype=args.dtype)
    meta = {"model": args.model or "embedded SmolLM2-135M-Instruct", "device": raw.device.iloc[0],
            "dtype": raw.dtype.iloc[0], "threads": args.threads, "n": args.length, "ratio": args.ratio,
            "decode_steps": args.decode_steps, "command": "python -m evaluation.bench price " + shlex.join(argv),
            "elapsed_s": time.time() - start, "loadavg_start": load_start, "loadavg": common.loadavg()}
    record = summarise(raw, meta)
    out = Path(args.out)
    common.write_markdown(out / "price-raw.jsonl", raw.to_json(orient="records", lines=True))
    common.write_markdown(out / "price.jsonl", record.to_json(orient="records", lines=True))
    common.write_markdown(out / "price.md", markdown(record, raw))
    print(markdown(record, raw))
    return record
