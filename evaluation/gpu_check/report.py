"""The GPU check's markdown: accuracy, kernels, prefill against snapkv, decode against plain."""

from __future__ import annotations

import statistics


def _decode_ratios(rows: list[dict]) -> list[tuple]:
    """(model, n, corrected fused / plain same kept set, corrected fused / full sdpa, / full FA2)."""
    out = []
    for model, n in sorted({(r["model"], r["n"]) for r in rows}):
        at = {r["variant"]: r["median_step_ms"] for r in rows if r["model"] == model and r["n"] == n}
        fused = at.get("prob_snapkv corrected, fused")
        if fused is None:
            continue
        ratio = lambda key: fused / at[key] if key in at else None  # noqa: E731
        out.append((model, n, ratio("prob_snapkv same kept set, plain sdpa"), ratio("full, sdpa"),
                    ratio("full, flash_attention_2")))
    return out


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [f"# GPU check: {report['device']}" + (" (DRY RUN on the CPU, shrunk models)" if report["dry_run"] else ""),
             "", f"torch {report['torch']}, CUDA {report['cuda']}, flash_attn installed: {report['flash_attn']}; "
             f"lengths {report['lengths']}; r = {report['ratio']}; {report['elapsed_s']:.0f} s.",
             f"Skipped for the time budget: {', '.join(report['skipped']) or 'nothing'}.", "",
             f"tests/test_cuda.py: {steps['pytest']}", "", "## Accuracy against float64", "",
             "| model | check | value | tolerance | ok |", "| :--- | :--- | ---: | ---: | :--- |"]
    for model, checks in steps["accuracy"].items():
        for name, c in checks.items():
            lines.append(f"| {model} | {name} | {c['value']:.2e} | {c['tolerance']:.2e} | {c['ok']} |")
    lines += ["", "## Decode step: corrected (fused) over ...", "",
              "| model | n | plain, same kept set (target <= 1.10) | full cache, SDPA | full cache, FA2 |",
              "| :--- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {n} | {_f(a)} | {_f(b)} | {_f(c)} |" for m, n, a, b, c in _decode_ratios(steps["decode"])]
    lines += ["", "| model | n | variant | median step ms | decoded by |", "| :--- | ---: | :--- | ---: | :--- |"]
    lines += [f"| {r['model']} | {r['n']} | {r['variant']} | {r['median_step_ms']:.2f} | {r.get('route', '-')} |"
              for r in steps["decode"]]
    lines += price_lines(report)
    lines += ragged_lines(report)
    lines += ["", "## Prefill against snapkv (peak: above the start; target peak - snapkv's <= 0.10 K+V)", "",
              "| model | n | press | s | time / snapkv | peak MiB | (peak - snapkv) / K+V |",
              "| :--- | ---: | :--- | ---: | ---: | ---: | ---: |"]
    for r in steps["prefill"]:
        ref = [s["seconds"] for s in steps["prefill"] if (s["model"], s["n"], s["press"]) == (r["model"], r["n"], "snapkv")]
        lines.append(f"| {r['model']} | {r['n']} | {r['press']} | {r['seconds']:.2f} | "
                     f"{_f(r['seconds'] / statistics.median(ref) if ref else None)} | {r['peak_extra_bytes'] / 2**20:.0f} | "
                     f"{_f(r.get('peak_minus_snapkv_over_kv'))} |")
    lines += ["", "## Compilations of the fused route over one generation (prob_snapkv's biased cache)", "",
              "| model | steps | graphs compiled | frames | routes | compiled route |", "| :--- | ---: | ---: | ---: | :--- | :--- |"]
    lines += [f"| {m} | {c['steps']} | {c['graphs']} | {c['frames']} | {', '.join(c['routes'])} | {c['compiled']} |"
              for m, c in steps.get("compilations", {}).items()]
    lines += ["", "## Kernels of one decoding step (top by self time)", ""]
    lines += [f"- {k}: {', '.join(v)}" for k, v in steps["kernels"].items()]
    return "\n".join(lines) + "\n"


def ragged_lines(report: dict) -> list[str]:
    """The ragged cache's attention routes against float64, and the ragged KVzip global press's decode step on
    each route over snapkv's plain step."""
    steps = report["steps"]
    lines = ["", "## Ragged cache: every attention route against float64 (bf16; tolerance: twice dense SDPA's error)", "",
             "| model | route, forward | value | tolerance | ok |", "| :--- | :--- | ---: | ---: | :--- |"]
    for model, checks in steps.get("ragged_accuracy", {}).items():
        for name, c in checks.items():
            lines.append(f"| {model} | {name} | " + (f"{c['value']:.2e} | {c['tolerance']:.2e} | {c['ok']} |" if "value"
                                                      in c else f"skipped: {c['skipped']} | | |"))
    lines += ["", "## Ragged cache: decode step of the ragged KVzip global press over snapkv's (plain SDPA)", "",
              "| model | n | press | route | auto | median step ms | snapkv's ms | over snapkv | decoded by |",
              "| :--- | ---: | :--- | :--- | :--- | ---: | ---: | ---: | :--- |"]
    lines += [f"| {r['model']} | {r['n']} | {r['press']} | {r['route']} | {r['auto']} | {r['median_step_ms']:.2f} | "
              f"{r['snapkv_step_ms']:.2f} | {r['over_snapkv']:.3f} | {r['decoded_by']} |" for r in steps.get("ragged_decode", [])]
    return lines


def price_lines(report: dict) -> list[str]:
    """RECOMMENDED's price over snapkv's per model and length (the price record, ``price.jsonl``)."""
    rows = [r for r in report["steps"].get("price", []) if r["press"] != "snapkv"]
    cell = lambda r, s: f"{r[f'{s}_over_snapkv']:.2f} [{r[f'{s}_over_snapkv_lo']:.2f}, {r[f'{s}_over_snapkv_hi']:.2f}]"  # noqa: E731
    lines = ["", f"## Price of RECOMMENDED = `{report.get('recommended')}` over snapkv's (price.jsonl)", "",
             "Median [range] over rounds of the per-round ratio; KVzip's scores fresh at every prefill; decode at the "
             "kept length; peak: max_memory_allocated above the start. Learned gate and profile: "
             f"{report.get('learned_artefacts', 'trained for the model')}.", "",
             "| model | n | rounds | prefill time | prefill peak | (peak - snapkv's) / K+V | decode step | decoded by |",
             "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | :--- |"]
    for r in rows:
        ref = next(s for s in report["steps"]["price"] if (s["model"], s["n"], s["press"]) == (r["model"], r["n"], "snapkv"))
        lines.append(f"| {r['model']} | {r['n']} | {r['rounds']} | {cell(r, 'prefill')} | {cell(r, 'peak')} | "
                     f"{(r['peak_bytes'] - ref['peak_bytes']) / r['kv_full_bytes']:.2f} | {cell(r, 'decode')} | "
                     f"{r['decode_route']} |")
    return lines
