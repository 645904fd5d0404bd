"""The prefill default, by measurement: ``python -m experiments.prefill_default``.

Times the prefill of each press label (a registry name, optionally ``name[field=value,...]``: e.g.
``prob_snapkv[prefill=recompute]``) at each length, side by side: every round runs every label at one
length in an order rotated each round, so load drift hits them alike. Each (length, round) is one
group, written to ``<out>/prefill_default/rows.jsonl`` as soon as it finishes; rerunning the same
command skips the groups already there (so a run longer than one call of the short lane is split
into calls). ``--max-seconds`` stops before a group that the previous group's time says would not
finish in time. The report (``report.md``, ``summary.json``) gives the median seconds, CPU seconds
and the peak memory above the start of each label, and each label's time over snapkv's in the same
round, median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_PRESSES = ["snapkv", "prob_snapkv", "prob_snapkv[prefill=recompute]", "prob_min_h_s256",
                   "prob_min_h_s256[prefill=recompute]"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.prefill_default", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/bench", help="output root (writes <out>/prefill_default/)")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--presses", nargs="+", default=DEFAULT_PRESSES)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None, help="stop before a group that would end past this")
    return p


def full_kv_bytes(model, n: int) -> int:
    """Bytes of the full keys and values of n tokens: 2 L H_kv n d times the element size."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * n * head_dim * next(model.parameters()).element_size()


def done_groups(rows: list[dict]) -> set:
    return {(r["n"], r["repeat"]) for r in rows}


def summarise(rows: list[dict], presses: list[str]) -> dict:
    """Per length and label: median seconds, CPU seconds, peak; the median over rounds of time / snapkv's."""
    out = {}
    for n in sorted({r["n"] for r in rows}):
        at = [r for r in rows if r["n"] == n]
        table = {}
        for label in presses:
            mine = [r for r in at if r["press"] == label]
            if not mine:
                continue
            ratios = []
            for r in mine:
                ref = [s for s in at if s["press"] == "snapkv" and s["repeat"] == r["repeat"]]
                if ref:
                    ratios.append(r["seconds"] / ref[0]["seconds"])
            table[label] = {"rounds": len(mine), "seconds": statistics.median(r["seconds"] for r in mine),
                            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in mine),
                            "peak_extra_mib": max(r["extra_bytes"] for r in mine) / 2**20,
                            "over_snapkv": statistics.median(ratios) if ratios else None,
                            "over_snapkv_rounds": ratios, "full_kv_mib": mine[0]["full_kv_bytes"] / 2**20}
        out[str(n)] = table
    return out


def markdown(summary: dict, info: dict) -> str:
    m = info["machine"]
    lines = ["# Prefill default", "",
             f"Command: `{info['command']}`. Machine: {m['cpu_count']} CPUs, torch {m['torch']}, {info['threads']} "
             f"thread(s), load average at the start of the last call {m.get('loadavg_start')}. Model: {info['model']}; "
             f"r = {info['ratio']}.",
             "Each round runs every label at one length in a rotated order; ratios are to snapkv's time in the same "
             "round, median over rounds. Peak: the rise of the process's memory during the prefill (the largest "
             "over rounds; on a CPU the resident set's high-water mark).", ""]
    for n, table in summary.items():
        lines += [f"## n = {n} (full K+V {next(iter(table.values()))['full_kv_mib']:.0f} MiB)", "",
                  "| press | rounds | median s | median CPU s | time / snapkv (per round) | peak MiB |",
                  "| :--- | ---: | ---: | ---: | :--- | ---: |"]
        for label, row in table.items():
            per = ", ".join(f"{x:.3f}" for x in row["over_snapkv_rounds"])
            ratio = f"**{row['over_snapkv']:.3f}** ({per})" if row["over_snapkv"] is not None else "-"
            lines.append(f"| {label} | {row['rounds']} | {row['seconds']:.1f} | {row['cpu_seconds']:.1f} | {ratio} | "
                         f"{row['peak_extra_mib']:.0f} |")
        lines.append("")
    return "\n".join(lines)


@torch.no_grad()
def main(argv=None) -> dict:
    from evaluation.bench import common
    from evaluation.bench.memory.child import press_config
    from evaluation.bench.speed.measure import clear_biases
    from evaluation.engine import press_prefill

    args = parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out) / "prefill_default"
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    start, model, tokenizer = time.time(), *common.load(args.model)
    presses = list(dict.fromkeys(["snapkv", *args.presses]))
    info = {"command": "python -m experiments.prefill_default " + " ".join(argv or []),
            "machine": common.machine_info(), "model": args.model or "embedded SmolLM2-135M-Instruct",
            "ratio": args.ratio, "threads": torch.get_num_threads()}
    last: dict[int, float] = {}
    warmed = False
    for n in args.lengths:
        ids = None
        for rep in range(args.repeats):
            if (n, rep) in done_groups(rows):
                continue
            guess = last.get(n) or max((t * (n / m) ** 1.5 for m, t in last.items()), default=0.0)
            if args.max_seconds is not None and time.time() - start + guess > args.max_seconds:
                print(f"[prefill-default] stopping before n={n} round {rep}: --max-seconds", flush=True)
                return summarise(rows, presses)
            ids = ids if ids is not None else common.context_ids(tokenizer, n, device=model.device)
            if not warmed:  # one untimed short prefill: first-call costs out of the timed ones
                press_prefill(model, ids[:, :256], press_config("snapkv", args.ratio).build())
                warmed = True
            began, group = time.time(), []
            order = presses[rep % len(presses):] + presses[: rep % len(presses)]
            for label in order:
                press = press_config(label, args.ratio, seed=rep).build()
                with common.PeakMemory(model.device) as memory, common.Stopwatch(model.device) as watch:
                    cache = press_prefill(model, ids, press)
                full = full_kv_bytes(model, n)
                group.append({"n": n, "repeat": rep, "press": label, "seconds": watch.wall, "cpu_seconds": watch.cpu,
                              "extra_bytes": memory.extra_bytes, "method": memory.method, "full_kv_bytes": full,
                              "loadavg": (common.loadavg() or [None])[0]})
                print(f"[prefill-default] n={n} round {rep} {label}: {watch.wall:.1f} s", flush=True)
                clear_biases(model)
                del cache, press
            last[n] = time.time() - began
            with rows_path.open("a") as f:
                for row in group:
                    f.write(json.dumps(row) + "\n")
            rows += group
            summary = summarise(rows, presses)
            (out / "summary.json").write_text(json.dumps({"info": info, "summary": summary}, indent=1))
            (out / "report.md").write_text(markdown(summary, info))
    summary = summarise(rows, presses)
    print(markdown(summary, info))
    return summary


if __name__ == "__main__":
    main()
