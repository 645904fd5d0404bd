"""The memory bench's tables and checks: ``memory.md``, ``memory.json``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.bench import common

MIB = 2.0**20


def block_seconds(row: pd.Series) -> float:
    """A prefill case's time: the fastest of its repeats timed without the memory sampler, else the
    measured run's."""
    repeats = row.get("repeat_seconds")
    return min(repeats) if isinstance(repeats, list) and repeats else row.get("seconds", float("nan"))


#: (what the label names, peak target in K+V above snapkv, time target in snapkv's) of the memory targets (docs/research/README.md)
#: (None: no time target). KVzip's presses hold the full K+V until scored, by design: nothing beyond it (1.1).
MODE_TARGETS = {"budget=layer": (0.10, 1.10), "prefill=recompute": (0.10, 2.2), "kvzip": (1.10, None)}


def against_snapkv(rows: pd.DataFrame) -> pd.DataFrame:
    """Each prefill ("press" case) beside snapkv's at the same length: the peak rise above snapkv's
    in K+V, and the prefill time in snapkv's."""
    press = rows[rows.case == "press"]
    out = []
    for n, group in press.groupby("n"):
        snap = group[group.press == "snapkv"]
        if not len(snap):
            continue
        snap = snap.iloc[0]
        for _, row in group.iterrows():
            out.append({"press": row.press, "n": int(n), "peak rise - snapkv, in K+V": (row.extra_bytes - snap.extra_bytes) / row.kv_bytes,
                        "time / snapkv": block_seconds(row) / block_seconds(snap), "seconds": block_seconds(row)})
    return pd.DataFrame(out)


def mode_checks(rows: pd.DataFrame) -> list[dict]:
    """The memory targets at the largest length, for every press whose label names a mode."""
    table = against_snapkv(rows)
    out = []
    if not len(table):
        return out
    for _, row in table[table.n == table.n.max()].iterrows():
        for mode, (peak, time) in MODE_TARGETS.items():
            if mode in row.press:
                value = row["peak rise - snapkv, in K+V"]
                out.append({"target": f"prefill peak {row.press} - snapkv, in K+V <= {peak}", "n": row.n, "value": value,
                            "met": bool(value <= peak)})
                value = row["time / snapkv"]
                if time is None:
                    out.append({"target": f"(info) prefill time {row.press} / snapkv", "n": row.n, "value": value,
                                "met": None})
                    continue
                out.append({"target": f"prefill time {row.press} / snapkv <= {time}", "n": row.n, "value": value,
                            "met": bool(value <= time)})
    return out


def checks(rows: pd.DataFrame, ratio: float) -> pd.DataFrame:
    """The memory targets, where the cases they compare were run (NaN: not run)."""
    out = []

    def extra(case, press, n):
        sub = rows[(rows.case == case) & (rows.press == press) & (rows.n == n)]
        return sub.iloc[0] if len(sub) else None

    for n in sorted(rows.n.unique()):
        runner, pipeline = extra("runner", "prob_min_h", n), extra("pipeline", "prob_min_h", n)
        if runner is not None and pipeline is not None:
            value = (runner.peak_bytes - pipeline.peak_bytes) / runner.kv_bytes
            out.append({"target": f"runner (prob_min_h, r={ratio}) - kvpress pipeline (prob_min_h), peak, in K+V <= 2",
                        "n": n, "value": value, "met": bool(value <= 2)})
            value = (runner.ru_maxrss_bytes - pipeline.ru_maxrss_bytes) / runner.kv_bytes
            out.append({"target": "(info) the same, max RSS of the two fresh processes, in K+V", "n": n, "value": value,
                        "met": None})
        mine, snap, prob_snap = extra("press", "prob_min_h", n), extra("press", "snapkv", n), extra("press", "prob_snapkv", n)
        if mine is not None and snap is not None:
            value = (mine.extra_bytes - snap.extra_bytes) / mine.kv_bytes
            out.append({"target": "prefill peak prob_min_h - snapkv, in K+V <= 0.10", "n": n, "value": value,
                        "met": bool(value <= 0.10)})
        if prob_snap is not None and snap is not None:
            value = (prob_snap.extra_bytes - snap.extra_bytes) / prob_snap.kv_bytes
            out.append({"target": "(info) prefill peak prob_snapkv - snapkv (eviction at the last layer), in K+V",
                        "n": n, "value": value, "met": None})
        if mine is not None and prob_snap is not None:
            value = (mine.extra_bytes - prob_snap.extra_bytes) / mine.kv_bytes
            out.append({"target": "(info) prefill peak prob_min_h - prob_snapkv (the proposal's own cost), in K+V",
                        "n": n, "value": value, "met": None})
        decode = rows[(rows.case == "decode") & (rows.n == n)]
        for _, row in decode.iterrows():
            bound = row.stacked_bytes - row.items_bytes + row.one_layer_stack_bytes
            value = row.stack_extra_bytes / bound
            out.append({"target": f"stack of B={int(row.batch)} caches: peak rise / (stack growth + one layer's stack) <= 1",
                        "n": n, "value": value, "met": bool(value <= 1)})
            out.append({"target": f"(info) generate_batch of B={int(row.batch)} caches: peak rise / the B caches",
                        "n": n, "value": row.extra_bytes / row.items_bytes, "met": None})
    return pd.DataFrame(out + mode_checks(rows))


def table(rows: pd.DataFrame) -> pd.DataFrame:
    cols = {"case": rows.case, "press": rows.press, "n": rows.n_context,
            "K+V MiB": rows.kv_bytes / MIB, "peak rise MiB": rows.extra_bytes / MIB,
            "rise / K+V": rows.extra_bytes / rows.kv_bytes, "peak MiB": rows.peak_bytes / MIB,
            "process max RSS MiB": rows.ru_maxrss_bytes / MIB,
            "block s": rows.apply(block_seconds, axis=1) if "seconds" in rows else float("nan")}
    return pd.DataFrame(cols).sort_values(["n", "case", "press"], kind="stable")


def markdown(rows: pd.DataFrame, check: pd.DataFrame, settings: dict, info: dict) -> str:
    shown = check.copy()
    if len(shown):
        shown["met"] = shown.met.map({True: "MET", False: "MISSED", None: "–"})
    decode = rows[rows.case == "decode"]
    lines = [
        "# Peak memory, each case in a fresh process\n",
        f"`{settings['command']}`\n",
        common.machine_markdown(info),
        f"\nMethod: {rows.method.iloc[0]}. 'peak rise' is the measured block's peak above what its process held "
        "before the block (model, inputs, imports); 'peak' is the process's measured memory at that peak; 'process max "
        "RSS' is the whole process's maximum (model load included). Every case runs in a fresh process with the "
        "same imports, the weights made resident by a warm-up forward first. "
        "K+V is the full cache of the context, 2 L H_kv d n bytes per element.\n",
        "## Checks\n",
        common.markdown_table(shown.set_index("target"), float_format="{:.3f}") if len(shown) else "(none)\n",
        "\n## Cases\n",
        "`press`: the prefill under the press (kvpress pipeline's); `engine`: the runner's prefill (`engine.Prefill` "
        "with the press announced, then `compress`); `pipeline`: kvpress's pipeline answering one RULER example; "
        "`runner`: `evaluation.engine.runner.run` on that example (full reference + the press); `decode`: "
        "`engine.generate_batch` of B compressed caches.\n",
        common.markdown_table(table(rows).set_index("case"), float_format="{:.2f}"),
    ]
    relative = against_snapkv(rows)
    if len(relative):
        lines += ["\n## Each prefill beside snapkv's\n",
                  "The `press` cases at each length: peak rise above snapkv's, in the context's K+V, and the prefill "
                  f"time in snapkv's (the fastest of {settings.get('repeats') or 0} repeats timed after the measured "
                  "run when repeats > 0, else the measured run). A label's brackets are its overrides: "
                  "`budget=layer` cuts each layer at its hook; `prefill=deferred` / `prefill=recompute` are the global "
                  "budget's modes (docs/research/README.md).\n",
                  common.markdown_table(relative.set_index("press"), float_format="{:.3f}")]
    if len(decode):
        d = pd.DataFrame({"press": decode.press, "B": decode.batch, "n": decode.n_context,
                          "B caches MiB": decode.items_bytes / MIB, "stack MiB": decode.stacked_bytes / MIB,
                          "one layer's stack MiB": decode.one_layer_stack_bytes / MIB,
                          "stack: peak rise MiB": decode.stack_extra_bytes / MIB,
                          "generate_batch: peak rise MiB": decode.extra_bytes / MIB})
        lines += ["\n## Batched decoding\n",
                  "The B caches are held before the block; `stack` copies them layer by layer into the batched cache "
                  "(padded to each layer's longest, with room for the question and answer) and frees each item's "
                  "layer as it goes, so its rise is bounded by the stack's growth over the B caches (padding and room) "
                  "plus one layer's stack; holding both at once would add the B caches again. `generate_batch` adds "
                  "the decoding's activations (the question's forward on B rows).\n",
                  common.markdown_table(d.set_index("press"), float_format="{:.2f}")]
    return "\n".join(lines) + "\n"


def write_outputs(rows: list[dict], settings: dict, info: dict, out: Path, status: str) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    check = checks(frame, settings["ratio"])
    common.write_json(out / "memory.json", {"status": status, "settings": settings, "machine": info,
                                            "checks": check, "rows": frame})
    common.write_markdown(out / "memory.md", f"Status: **{status}**\n\n" + markdown(frame, check, settings, info))
    return check
