"""The shared-prefill bench's summary and outputs: ``shared_prefill.json``, ``shared_prefill.md``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from evaluation.bench import common


def summarise(rows: list[dict], settings: dict, machine: dict) -> dict:
    total_naive, total_shared = sum(r["naive_s"] for r in rows), sum(r["shared_s"] for r in rows)
    total_batched = sum(r["batched_s"] for r in rows)
    return dict(
        **settings, machine=machine, examples=rows,
        total_naive_s=total_naive, total_shared_s=total_shared, total_batched_s=total_batched,
        speedup=total_naive / total_shared, speedup_batched=total_naive / total_batched,
        all_identical=all(r["identical"] for r in rows), all_identical_batched=all(r["identical_batched"] for r in rows),
    )


def markdown(summary: dict) -> str:
    table = common.markdown_table(pd.DataFrame(summary["examples"]), index=False, float_format="{:.2f}")
    machine = {k: summary["machine"].get(k) for k in ("platform", "cuda_device", "torch_threads", "torch")}
    return (f"# Shared prefill vs the naive pipeline loop\n\n`{summary['command']}` · {len(summary['presses'])} "
            f"configurations at r = {summary['ratio']} · {machine}\n\n{table}\n"
            f"Total: naive {summary['total_naive_s']:.1f} s; shared prefill {summary['total_shared_s']:.1f} s, speed-up "
            f"{summary['speedup']:.2f}x, identical predictions: {summary['all_identical']}; shared prefill + batched "
            f"decoding {summary['total_batched_s']:.1f} s, **speed-up {summary['speedup_batched']:.2f}x**, identical "
            f"predictions: {summary['all_identical_batched']}.\n")


def write_outputs(summary: dict, out: Path) -> str:
    common.write_json(out / "shared_prefill.json", summary)
    md = markdown(summary)
    common.write_markdown(out / "shared_prefill.md", md)
    return md
