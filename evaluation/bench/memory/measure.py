"""The memory bench's cases, each in a fresh subprocess (``child``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from evaluation.engine.runner import REFERENCE


def cases(lengths: list[int], presses: list[str], paths: list[str], ratio: float, pipeline_presses: list[str], runner_presses: list[str],
          decode_press: str, batch: int, decode_batch: int, repeats: int = 0) -> list[dict]:
    """Every case, lengths in order; at each length the compared cases run side by side."""
    out = []
    for n in lengths:
        for name in presses:
            for path in paths:
                if path == "press" or name != REFERENCE:
                    out.append(dict(case=path, n=n, press=name, ratio=ratio, repeats=repeats))
        for name in pipeline_presses:
            out.append(dict(case="pipeline", n=n, press=name, ratio=ratio))
        for name in runner_presses:
            out.append(dict(case="runner", n=n, press=name, ratio=ratio, decode_batch=decode_batch))
        if batch > 0:
            out.append(dict(case="decode", n=n, press=decode_press, ratio=ratio, batch=batch))
    return out


def run_case(spec: dict, model: str | None, threads: int | None, log=print) -> dict:
    """One case in a fresh ``python -m evaluation.bench.memory.child`` process; its JSON line."""
    spec = {**spec, "model": model, "threads": threads}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**19)}  # large tensors mapped alone: RSS follows live tensors
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-m", "evaluation.bench.memory.child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory case {spec} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"[memory] {row['case']:8s} {row['press']:12s} n={row['n']}: +{row['extra_bytes'] / 2**20:.0f} MiB "
        f"(K+V {row['kv_bytes'] / 2**20:.0f} MiB, max RSS {row['ru_maxrss_bytes'] / 2**20:.0f} MiB)")
    return row
