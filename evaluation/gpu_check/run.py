"""``kvprob gpu-check``: the GPU path in one command (docs/gpu-and-memory.md).

On one GPU, offline, in bfloat16, random weights of the paper's exact shapes (``models``), at 4k,
32k and 128k tokens, within ``--budget-s`` (default 450 s, model loading aside: a step that the time spent so far says
would not fit is skipped and listed as such):

1. the corrected attention against float64 (fused and SDPA routes) and the TF32 proposal's mass;
2. the kernel each decoding path runs, from the profiler (plain SDPA, FA2 when installed, the
   corrected attention fused and through SDPA);
3. per model and length: the prefill time and peak of each press family against snapkv's;
4. per model and length: the decode step time, corrected (fused) against plain decoding of the same
   kept set, against the corrected SDPA route, and against FA2 / SDPA on the full cache, each with the
   attention function that decoded it (a spy: ``evaluation.bench.speed.route``);
5. per model and length, ``RECOMMENDED``'s price against snapkv's (``evaluation.bench.speed.price``, the
   CPU bench's measurement: prefill time, prefill peak, decode step at the kept length, decode route,
   KVzip's scores fresh at every prefill; 2 rounds, 1 at 128k), at 4k and 32k on both models and at 128k
   on Llama-3.2-3B (``PRICE_LONGEST``), written as a price record;
6. per model, the compilations of the fused route over one generation on a biased cache (prob_snapkv's):
   one compiled kernel for every step;
7. the ragged cache (``kvpress_prob.cache``): every attention route over a ragged layer against float64 at each
   model's head shapes (``checks.ragged_accuracy``), and per model and length the decode step of ``RAGGED``
   (KVzip's global kept set, evicted for real) on each route that decodes it, over snapkv's plain step;
8. ``tests/test_cuda.py`` (pytest, in a child process), last, with what is left of the budget.

Writes ``<out>/<device>/gpu-check.json``, ``gpu-check.md`` and ``price.jsonl`` (the price record,
``evaluation.report.price``; default out: results/gpu). ``--dry-run`` runs every step on the CPU with shrunk
models and lengths 128 / 256 in a few seconds (the test suite runs it), pytest excluded.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

PRESSES = ["snapkv", "prob_snapkv", "prob_min_h_s256", "prob_min_h", "h2o", "knorm", "prob_knorm", "streaming_llm"]
#: longest length each press is prefilled at (the O(n^2) proposals are estimated minutes at 128k)
MAX_LENGTH = {"prob_min_h": 32768, "h2o": 32768}
#: the longest length RECOMMENDED's price is measured at, per model (128k on one model only: the time budget)
PRICE_LONGEST = {"qwen3-4b": 32768}
PRICE_ROUNDS = {131072: 1}  # rounds of the price at a length (default 2)
RAGGED = "topk_kvzip_global"  # the ragged press whose decode step is timed on each route
TARGETS = {"decode corrected (fused) / plain, same kept set": 1.10, "prefill peak - snapkv's, in K+V": 0.10}


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvprob gpu-check", description=__doc__.split("\n")[0], add_help=add_help)
    p.add_argument("--dry-run", action="store_true", help="on the CPU, shrunk models, lengths 128 256")
    p.add_argument("--out", default="results/gpu", help="writes <out>/<device>/gpu-check.{json,md}")
    p.add_argument("--models", nargs="+", default=["llama-3.2-3b", "qwen3-4b"])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 4096 32768 131072 (dry run: 128 256)")
    p.add_argument("--presses", nargs="+", default=PRESSES)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="skip a step that would end past this (the last 120 s are tests/test_cuda.py's)")
    p.add_argument("--no-pytest", action="store_true", help="skip tests/test_cuda.py")
    return p


class Budget:
    """Seconds left of ``total``; ``fits(estimate)`` before a step, every skip recorded."""

    def __init__(self, total: float, reserve: float = 0.0):
        self.start, self.total, self.reserve, self.skipped = time.time(), total, reserve, []

    def fits(self, what: str, estimate: float) -> bool:
        """Whether a step of ``estimate`` seconds ends before the total less the reserve (pytest's)."""
        if time.time() - self.start + estimate <= self.total - self.reserve:
            return True
        self.skipped.append(what)
        return False


def device_name(dry_run: bool) -> str:
    if dry_run or not torch.cuda.is_available():
        return "cpu-dry-run" if dry_run else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(0)).strip("-").lower()


def run_pytest(budget: Budget) -> dict:
    """tests/test_cuda.py in a child process, last, with what is left of the budget (at least 60 s)."""
    left = max(budget.reserve, budget.total - (time.time() - budget.start))
    root = Path(__file__).resolve().parents[2]  # the repository: tests/ lives there
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_cuda.py"], capture_output=True,
                              text=True, cwd=root, timeout=left)
    except subprocess.TimeoutExpired:
        budget.skipped.append(f"tests/test_cuda.py (stopped after {left:.0f} s)")
        return {"status": f"stopped after {left:.0f} s"}
    return {"returncode": done.returncode, "tail": done.stdout.strip().splitlines()[-3:]}


def main(argv=None) -> dict:
    from evaluation.bench.speed import price
    from evaluation.gpu_check import checks, models
    from kvpress_prob import attention_dispatch
    from kvpress_prob.learned.stand_in import stand_in_artefacts
    from kvpress_prob.names.registry import RECOMMENDED

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("kvprob gpu-check: no CUDA device here; run it with --dry-run to check the path on the CPU")
    lengths = args.lengths or ([128, 256] if args.dry_run else [4096, 32768, 131072])
    pytest = not (args.dry_run or args.no_pytest)
    budget = Budget(args.budget_s, reserve=120.0 if pytest else 0.0)
    report = {"device": device_name(args.dry_run), "dry_run": args.dry_run, "torch": torch.__version__,
              "cuda": torch.version.cuda, "flash_attn": models.flash_attn_available(), "lengths": lengths,
              "ratio": args.ratio, "steps": {}}
    out = Path(args.out) / report["device"]
    rows = report["steps"]
    rows["accuracy"], rows["kernels"], rows["prefill"], rows["decode"] = {}, {}, [], []
    rows["price"], rows["compilations"] = [], {}
    rows["ragged_accuracy"], rows["ragged_decode"] = {}, []
    report["recommended"] = RECOMMENDED
    report["learned_artefacts"] = "untrained stand-ins (random weights): prices only"
    for name in args.models:
        cfg = models.config(name, args.dry_run)
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rows["accuracy"][name] = checks.accuracy(hq, hkv, d, 4096 if not args.dry_run else 128, device)
        rows["ragged_accuracy"][name] = checks.ragged_accuracy(hq, hkv, d, 4096 if not args.dry_run else 128, device)
        model = models.build(name, device, dry_run=args.dry_run, max_length=max(lengths))
        last = None  # (n, seconds) of the previous length: the next one's estimate
        for n in lengths:
            if not budget.fits(f"{name} n={n}", 0 if last is None else last[1] * (n / last[0]) ** 1.3):
                continue
            began = time.time()
            ids = torch.randint(10, model.config.vocab_size - 10, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
            kv = 2 * cfg.num_hidden_layers * hkv * n * d * 2
            # RECOMMENDED's price first: the budget skips what comes later, never the recommendation
            if n <= PRICE_LONGEST.get(name, n) and budget.fits(f"{name} n={n} price of {RECOMMENDED}", 0):
                meta = {"model": name, "device": report["device"], "dtype": str(model.dtype),
                        "threads": torch.get_num_threads(), "n": n, "ratio": args.ratio, "decode_steps": args.decode_steps,
                        "command": "kvprob gpu-check " + shlex.join(argv), "loadavg": None}
                with stand_in_artefacts(model):  # random weights: untrained gate and profile, their price only
                    raw = price.run_here(model, ids, ["snapkv", RECOMMENDED], args.ratio, PRICE_ROUNDS.get(n, 2),
                                         args.decode_steps, 2,
                                         log=lambda line: print(f"[gpu-check] {name} n={n} {line}", flush=True))
                rows["price"] += price.summarise(raw, meta | {"elapsed_s": time.time() - began}).assign(
                    kv_full_bytes=kv).to_dict(orient="records")
            caches, snapkv_peak = {}, None
            for label in args.presses:
                if n > MAX_LENGTH.get(label, n) or not budget.fits(f"{name} n={n} prefill {label}", 0):
                    continue
                cache, row = checks.prefill(model, ids, label, args.ratio)
                snapkv_peak = row["peak_extra_bytes"] if label == "snapkv" else snapkv_peak
                rows["prefill"].append({"model": name, "n": n, "press": label, **row, "kv_bytes": kv})
                if label in ("prob_snapkv", "snapkv"):
                    caches[label] = cache
                del cache
            for row in rows["prefill"]:
                if row["model"] == name and row["n"] == n and snapkv_peak is not None:
                    row["peak_minus_snapkv_over_kv"] = (row["peak_extra_bytes"] - snapkv_peak) / kv
            if "snapkv" in caches and budget.fits(f"{name} n={n} prefill {RAGGED}", 0):
                caches[RAGGED], row = checks.prefill(model, ids, RAGGED, args.ratio)
                rows["prefill"].append({"model": name, "n": n, "press": RAGGED, **row, "kv_bytes": kv,
                                        "peak_minus_snapkv_over_kv": (row["peak_extra_bytes"] - snapkv_peak) / kv})
            full, _ = checks.prefill(model, ids, "full", args.ratio)
            variants = {"full, sdpa": (full, "sdpa", "auto", "auto")}
            if report["flash_attn"]:
                variants["full, flash_attention_2"] = (full, "flash_attention_2", "auto", "auto")
            if "prob_snapkv" in caches:
                sampled = caches["prob_snapkv"]
                variants |= {"prob_snapkv corrected, fused": (sampled, "sdpa", "fused", "auto"),
                             "prob_snapkv corrected, sdpa mask": (checks_copy_with_bias(sampled), "sdpa", "sdpa", "auto"),
                             "prob_snapkv same kept set, plain sdpa": (checks.plain_copy(sampled), "sdpa", "auto", "auto")}
            if "snapkv" in caches:
                variants["snapkv, plain sdpa"] = (caches["snapkv"], "sdpa", "auto", "auto")
            for route in ragged_routes(device) if RAGGED in caches else []:  # a copy each: decoding appends
                variants[f"{RAGGED} ragged, {route}"] = (checks_copy_with_bias(caches[RAGGED]), "sdpa", "auto", route)
            if budget.fits(f"{name} n={n} decode", 0):
                timed = checks.decode(model, variants, n, args.decode_steps)
                rows["decode"] += [{"model": name, "n": n, "variant": v, **t} for v, t in timed.items()]
                rows["ragged_decode"] += ragged_decode_rows(name, n, timed, device)
            if n == lengths[0] and "prob_snapkv corrected, fused" in variants:
                for v, (cache, implementation, mode, route) in variants.items():
                    rows["kernels"][f"{name}: {v}"] = kernel_names(checks, model, cache, implementation, mode, route,
                                                                   n, device)
                if budget.fits(f"{name} compilations", 0):
                    rows["compilations"][name] = checks.compilations(
                        model, checks_copy_with_bias(variants["prob_snapkv corrected, fused"][0]), n, args.decode_steps)
            del variants, caches, full
            last = (n, time.time() - began)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    rows["pytest"] = run_pytest(budget) if pytest else {"status": "skipped: dry run or --no-pytest"}
    report["skipped"] = budget.skipped
    report["elapsed_s"] = time.time() - budget.start
    from evaluation.gpu_check.report import markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))
    (out / "price.jsonl").write_text("".join(json.dumps(row, default=str) + "\n" for row in rows["price"]))
    print(f"[gpu-check] wrote {out}/gpu-check.json, gpu-check.md and price.jsonl in {report['elapsed_s']:.0f} s")
    attention_dispatch.install()
    attention_dispatch.set_route(ragged="auto", corrected="auto")
    return report


def ragged_routes(device: str) -> list[str]:
    """The routes that decode a ragged cache without a bias on ``device``: the portable route, FlexAttention, the
    nested route, and flash-attn's varlen where it is installed and the device is CUDA."""
    from kvpress_prob.cache import ragged_fused

    return ["portable", "flex", "nested"] + (["flash"] if device == "cuda" and ragged_fused.flash_available() else [])


def ragged_decode_rows(model: str, n: int, timed: dict, device: str) -> list[dict]:
    """One row per route of ``RAGGED``'s decode step over snapkv's plain step (the same lockstep decode);
    ``auto``: the route ``attention_dispatch.set_route(ragged="auto")`` runs on ``device``."""
    from kvpress_prob.cache.ragged_attention import auto_route

    auto = auto_route(device)
    snapkv = timed["snapkv, plain sdpa"]["median_step_ms"]
    return [{"model": model, "n": n, "press": RAGGED, "route": v.rsplit(", ", 1)[1], "auto": v.endswith(f", {auto}"),
             "median_step_ms": t["median_step_ms"], "snapkv_step_ms": snapkv, "over_snapkv": t["median_step_ms"] / snapkv,
             "decoded_by": t["route"]} for v, t in timed.items() if v.startswith(f"{RAGGED} ragged, ")]


def checks_copy_with_bias(cache):
    """A copy of ``cache`` carrying its correction bias (so the two routes decode separate caches)."""
    import copy

    return copy.deepcopy(cache)


def kernel_names(checks, model, cache, implementation, mode, route, n, device) -> list[str]:
    import copy

    from kvpress_prob import attention_dispatch

    cache = copy.deepcopy(cache)
    previous = model.config._attn_implementation
    token = torch.tensor([[5]], device=device)

    def step():
        model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[n + 100]], device=device))

    previous_routes = attention_dispatch.set_route(corrected=mode, ragged=route)
    try:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            step()  # warm (a compiled kernel is built outside the profile)
            return checks.kernels(step, device)
    finally:
        attention_dispatch.set_route(**previous_routes)
        model.set_attn_implementation(previous)
