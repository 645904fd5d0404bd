"""One case of the memory bench in this (fresh) process: ``python -m evaluation.bench.memory.child '<json>'``.

Prints one JSON line: the case, ``start_bytes`` / ``peak_bytes`` / ``extra_bytes`` of the measured
block (``common.PeakMemory``), ``ru_maxrss_bytes`` of the whole process, and byte counts to compare.
The imports are the same for every case, so that the pipeline and the runner are compared alike,
and a warm-up forward makes the weights resident before any block is measured. Run it with
``MALLOC_MMAP_THRESHOLD_`` set (``measure.run_case`` does): glibc then maps every large tensor on
its own and returns it to the system when freed, so the resident set follows the live tensors
instead of the allocator's free lists.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
from kvpress import KVPressTextGenerationPipeline

from evaluation.bench import common
from evaluation.engine import Compressed, Prefill, generate_batch, press_prefill, stack
from evaluation.engine.runner import REFERENCE, Config, run
from evaluation.store.results import ResultStore
from evaluation.tasks.ruler.offline import generate_ruler
from kvpress_prob.cache import cache_held_bytes
from kvpress_prob.presses.kvzip_scoring import BoundedKVzipPress, tokenizer_of

MAX_NEW_TOKENS = 16


def kv_bytes(model, n: int) -> int:
    """Full K+V of n tokens: 2 * L * H_kv * d * n * bytes per element."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * n * model.dtype.itemsize


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def stack_bytes(items: list[Compressed], room: int) -> list[int]:
    """Bytes of each layer of ``engine.stack``'s batched cache: B x H_kv x (S_max + room) keys and
    values, and the (B, H_kv, S_max) bias."""
    out = []
    for layer in range(len(items[0].keys)):
        keys = items[0].keys[layer]  # (1, H_kv, S, d)
        s_max = max(item.keys[layer].shape[2] for item in items)
        out.append(len(items) * keys.shape[1] * ((s_max + room) * 2 * keys.shape[3] + s_max) * keys.element_size())
    return out


def press_config(label: str, ratio: float, seed: int = 0) -> Config:
    """The configuration named ``label``: a registry press, optionally with field overrides in the
    form ``Config.label`` prints them, ``name[field=value,...]`` (values are strings: ``budget``,
    ``prefill``)."""
    name, _, rest = label.partition("[")
    if rest and not rest.endswith("]"):
        raise ValueError(f"press {label!r}: overrides go in brackets, name[field=value,...]")
    pairs = [item.split("=", 1) for item in rest[:-1].split(",")] if rest else []
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"press {label!r}: each override is field=value")
    return Config(name, ratio, seed, tuple((key, value) for key, value in pairs))


def example(tokenizer, n: int) -> pd.Series:
    """One RULER example (seed 0, first task) generated at context length n."""
    return generate_ruler(tokenizer, n, 1, 0).iloc[0]


@torch.no_grad()
def measure(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    model, tokenizer = common.load(spec.get("model"))
    model.model(input_ids=torch.arange(3, 35, device=model.device)[None])  # warm-up: weights resident, kernels loaded
    case, n, name, ratio = spec["case"], spec["n"], spec["press"], spec["ratio"]
    out = {**spec, "device": str(model.device)}
    if case in ("press", "engine"):
        ids = common.context_ids(tokenizer, n, device=model.device)
        press = press_config(name, ratio).build()
        if isinstance(press, BoundedKVzipPress):
            tokenizer_of(model)  # a process's one-time load (KVzip's chat template), made before, as the weights are

        def block():
            if case == "press":
                return press_prefill(model, ids, press)
            return Prefill(model, ids, [press]).compress(press)

        with common.PeakMemory(model.device, anonymous=True) as memory, common.Stopwatch(model.device) as watch:
            cache = block()
        out["n_context"] = n
        out["cache_bytes"] = cache_held_bytes(cache)[0]  # K and V, each storage once (a ragged layer's buffers too)
        if press is not None and hasattr(press, "stats") and press.stats:
            out["realised_ratio"] = press.stats["realised_ratio"]
        del cache
        times = []
        for _ in range(spec.get("repeats", 0)):  # timed again without the memory sampler running beside
            with common.Stopwatch(model.device) as again:
                block()
            times.append(again.wall)
        out["repeat_seconds"] = times
    elif case in ("pipeline", "runner"):
        row = example(tokenizer, n)
        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)
        out["n_context"] = inputs["context_ids"].shape[1]
        if case == "pipeline":
            press = press_config(name, ratio).build()
            with common.PeakMemory(model.device, anonymous=True) as memory:
                out["answer"] = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                                     press=press, max_new_tokens=MAX_NEW_TOKENS)["answer"]
        else:
            configs = [Config(REFERENCE, 0.0, 0)] + ([Config(name, ratio, 0)] if name != REFERENCE else [])
            frame = pd.DataFrame([{**row.to_dict(), "max_new_tokens": MAX_NEW_TOKENS}])
            with tempfile.TemporaryDirectory() as tmp:
                store = ResultStore(Path(tmp) / "results.jsonl")
                with common.PeakMemory(model.device, anonymous=True) as memory:
                    run(model, tokenizer, frame, configs, store, model_name="bench", dataset="ruler", data_dir=str(n),
                        decode_batch=spec.get("decode_batch", 1), progress=False)
                out["answers"] = store.load().set_index("press").prediction.to_dict()
    elif case == "decode":
        row = example(tokenizer, n)
        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)
        context_ids, question_ids = inputs["context_ids"].to(model.device), inputs["questions_ids"][0].to(model.device)
        out["n_context"] = n_context = context_ids.shape[1]
        configs = [Config(name, ratio, seed) for seed in range(spec["batch"])]
        shared = Prefill(model, context_ids, [cfg.build() for cfg in configs])
        room = question_ids.shape[1] + MAX_NEW_TOKENS

        def compressed():
            return [Compressed.take(shared.compress(cfg.build()), shared.layers) for cfg in configs]

        items = compressed()
        out["items_bytes"] = tensor_bytes(t for item in items for t in (*item.keys, *item.values, *item.bias))
        stacks = stack_bytes(items, room)
        out["stacked_bytes"], out["one_layer_stack_bytes"] = sum(stacks), max(stacks)
        with common.PeakMemory(model.device, anonymous=True) as stacking:
            batched = stack(items, room)
        out["stack_extra_bytes"] = stacking.extra_bytes
        del batched, items
        items = compressed()
        with common.PeakMemory(model.device, anonymous=True) as memory:
            out["answers"] = generate_batch(model, tokenizer, question_ids, items, n_context, MAX_NEW_TOKENS)
    else:
        raise ValueError(f"unknown case {case!r}")
    out["kv_bytes"] = kv_bytes(model, out["n_context"])
    if case in ("press", "engine"):
        out.update(seconds=watch.wall, cpu_seconds=watch.cpu)
    out.update(method=memory.method, start_bytes=memory.start_bytes, peak_bytes=memory.peak_bytes,
               extra_bytes=memory.extra_bytes, ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
