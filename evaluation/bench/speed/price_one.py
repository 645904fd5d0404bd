"""One press's price in a process of its own: ``python -m evaluation.bench.speed.price_one '<json spec>'``.

The price bench (``evaluation.bench.speed.price``) starts this module once per press and round, with
``MALLOC_MMAP_THRESHOLD_`` set so that glibc returns every large block to the system when it is freed: the
resident set's high-water mark then counts what this press's prefill holds, not what an earlier prefill of the
same process left in the heap. The process loads the model, pays its one-time costs on a short untimed prefill
and two decoding steps, then prefills the context under the press (timed, its peak, its parts:
``evaluation.bench.speed.parts``) and decodes ``warmup_steps + decode_steps`` tokens on its cache (the first
under the route spy). It prints one JSON row, the last line of its output.

Besides the registry's names it takes ``ANCHORS``: presses of kvpress built as shipped (``kvpress_kvzip``:
``kvpress.KVzipPress``, unmodified: its dense scoring, its tokenizer loaded at every prefill, its masking).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from evaluation.bench import common
from evaluation.bench.speed.measure import set_masks
from evaluation.bench.speed.parts import Parts
from evaluation.bench.speed.route import route
from evaluation.engine import press_prefill
from evaluation.engine.runner import REFERENCE, Config
from kvpress_prob.cache import cache_held_bytes, mean_kept
from kvpress_prob.presses.kvzip_scoring import clear_scores
from kvpress_prob.presses.sampling import language_model


def _kvpress_kvzip(ratio: float):
    from kvpress import KVzipPress

    return KVzipPress(compression_ratio=ratio)


ANCHORS = {"kvpress_kvzip": _kvpress_kvzip}
WARMUP_TOKENS = 256  # the untimed prefill that pays the process's one-time costs


def build(name: str, ratio: float, seed: int):
    """The press ``name`` (an ``ANCHORS`` name, or the registry's through the runner's ``Config``)."""
    return ANCHORS[name](ratio) if name in ANCHORS else Config(name, ratio, seed).build()


def _step(model, cache, token: torch.Tensor, position: int) -> None:
    model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[position]], device=token.device))


def measure(spec: dict) -> dict:
    """The row of one press and round in this process (see the module); ``spec``: name, round, ratio, length,
    model, threads, decode_steps, warmup_steps, and optionally dtype."""
    torch.set_num_threads(spec["threads"])
    model, tokenizer = common.load(spec["model"], spec.get("dtype"))
    ids = common.context_ids(tokenizer, spec["length"], device=model.device)
    return price_row(model, ids, spec["name"], spec["round"], spec["ratio"], spec["decode_steps"], spec["warmup_steps"])


@torch.no_grad()
def price_row(model, ids: torch.Tensor, name: str, rep: int, ratio: float, decode_steps: int, warmup_steps: int) -> dict:
    """One press's row on ``ids``: a short untimed prefill and two steps first, then the timed prefill (seed
    ``rep``; KVzip's kept scores forgotten first) with its peak and parts, the load average around it, and its decode steps."""
    n = ids.shape[1]
    warm = press_prefill(model, ids[:, :WARMUP_TOKENS], None)
    for i in range(2):
        _step(model, warm, ids[0, i], min(n, WARMUP_TOKENS) + i)
    del warm
    press = build(name, ratio, rep) if name != REFERENCE else None
    clear_scores()  # a KVzip prefill scores a fresh context, also when rounds share a process (``run_here``)
    load_before = common.loadavg()
    with Parts(model, press) as parts, common.PeakMemory(model.device) as memory, \
            common.Stopwatch(model.device) as watch:
        cache = press_prefill(model, ids, press)
    load_after = common.loadavg()
    kv, bias = cache_held_bytes(cache)  # each storage once, a ragged layer's bias and a dense one's correction
    kept = statistics.mean(mean_kept(layer) for layer in cache.layers)
    tokens = torch.randint(100, 10000, (warmup_steps + decode_steps,),
                           generator=torch.Generator().manual_seed(0)).to(model.device)
    times, decode_route = [], None
    for i, token in enumerate(tokens):
        if i == 0:
            decode_route = route(model, lambda: _step(model, cache, token, n))
            continue
        with common.Stopwatch(model.device) as step:
            _step(model, cache, token, n + i)
        if i >= warmup_steps:
            times.append(step.wall)
    set_masks(model, [None] * len(language_model(model).layers))  # a masking press's (kvzip) masks go with its cache
    device = "cpu" if model.device.type == "cpu" else torch.cuda.get_device_name(model.device)
    return {"press": name, "round": rep, "device": device, "dtype": str(model.dtype), "prefill_s": watch.wall, "prefill_cpu_s": watch.cpu,
            "peak_bytes": memory.extra_bytes, "peak_method": memory.method, "start_bytes": memory.start_bytes,
            "kept_length": kept, "kv_bytes": kv,
            "bias_bytes": bias, "decode_ms": 1e3 * statistics.median(times), "decode_steps": len(times),
            "decode_route": decode_route, "loadavg_before": load_before, "loadavg_after": load_after,
            **{f"{part}_s": s for part, s in parts.seconds(watch.wall).items()}}


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
