"""Where a KVzip prefill's time goes, by operation: ``python -m evaluation.bench.speed.profile_ops --presses ...``.

One process, one thread by default. For each press, a short untimed prefill first, then one prefill of a RULER
context (``--length`` tokens) under ``torch.profiler``. Every operation's own time (``self_cpu_time_total``) is put
in a phase and a kind:

- phase: ``prefill`` (the first forward of the language model), ``reconstruction`` (its later forwards: KVzip's
  replay passes), ``scoring`` (the press's ``score_kvzip``), ``proposal`` (the press's ``tail``), ``allocation``
  (its ``compress_post``), ``other``;
- kind: ``projections`` (inside a q/k/v/o projection module), ``mlp`` (inside a layer's MLP), ``sdpa`` (inside
  an ``aten::scaled_dot_product_attention`` call), ``fused attention`` (inside the press's ``fused_attention``:
  the reconstruction's attention output and KVzip's score from one set of logits, ``kvzip_fused``),
  ``cache cat`` (an ``aten::cat`` in the attention module, outside the above: the cache update), ``copies``
  (clone, copy, contiguous), ``matmul``, ``softmax``, else ``other``.

Output: a JSON record and a markdown table (``--out``), seconds per phase and kind.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from evaluation.bench import common
from evaluation.engine import press_prefill
from evaluation.engine.runner import Config
from kvpress_prob.presses.kvzip_scoring import clear_scores
from kvpress_prob.presses.sampling import language_model

PHASES = ("prefill", "reconstruction", "scoring", "proposal", "allocation")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Label:
    """``record_function`` entered by a module's pre-hook and left by its hook."""

    def __init__(self, module, label: str):
        self.stack = []
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._exit)]
        self.label = label

    def _enter(self, *_):
        rf = record_function(self.label)
        rf.__enter__()
        self.stack.append(rf)

    def _exit(self, *_):
        self.stack.pop().__exit__(None, None, None)

    def remove(self):
        for h in self.handles:
            h.remove()


class _Wrapped:
    def __init__(self, function, label):
        self.function, self.label = function, label

    def __call__(self, *args, **kwargs):
        with record_function(self.label):
            return self.function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.function, name)


def labelled(model, press):
    """Labels on the model's modules and the press's parts; returns a function that removes them."""
    lm = language_model(model)
    labels, count = [], {"n": 0}
    class _Forward(_Label):
        def _enter(self, *_):
            self.label = "phase::prefill" if count["n"] == 0 else "phase::reconstruction"
            count["n"] += 1
            super()._enter()

    labels.append(_Forward(lm, ""))
    for layer in lm.layers:
        labels.append(_Label(layer.mlp, "kind::mlp"))
        labels.append(_Label(layer.self_attn, "kind::attention module"))
        for name in PROJECTIONS:
            labels.append(_Label(getattr(layer.self_attn, name), "kind::projections"))
    restore = {}
    if press is not None:
        for attribute, label in (("score_kvzip", "phase::scoring"), ("fused_attention", "fused::attention"),
                                 ("compress_post", "phase::allocation"), ("tail", "phase::proposal")):
            original = getattr(press, attribute, None)
            if original is None:
                continue
            restore[attribute] = original
            setattr(press, attribute, _Wrapped(original, label))

    def remove():
        for label in labels:
            label.remove()
        for attribute in restore:
            if attribute == "tail":
                setattr(press, attribute, restore[attribute])
            else:
                delattr(press, attribute)
    return remove


def kind_of(event) -> tuple[str, str]:
    """(phase, kind) of a profiler event, from its enclosing labels and its own name."""
    phase, kind, inside_sdpa, in_attention = "other", None, False, False
    node = event
    names = []
    while node is not None:
        names.append(node.name)
        node = node.cpu_parent
    for name in names:  # innermost first
        if name.startswith("phase::") and phase == "other":
            phase = name[len("phase::"):]
        if kind is None:
            if name in ("kind::projections", "kind::mlp"):
                kind = name[len("kind::"):]
            elif name == "fused::attention":
                kind = "fused attention"
            elif name == "aten::scaled_dot_product_attention":
                inside_sdpa = True
                kind = "sdpa"
        if name == "kind::attention module":
            in_attention = True
    if kind is None:
        op = event.name
        if op == "aten::cat":
            kind = "cache cat" if in_attention and phase in ("prefill", "reconstruction") else "cat"
        elif op in ("aten::clone", "aten::copy_", "aten::contiguous", "aten::to", "aten::_to_copy"):
            kind = "copies"
        elif op in ("aten::matmul", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::einsum"):
            kind = "matmul"
        elif "softmax" in op:
            kind = "softmax"
        else:
            kind = "other"
    return phase, kind


def profile_press(model, ids, name: str, ratio: float) -> dict:
    """Seconds by (phase, kind) of one prefill of ``ids`` under the press ``name``, and its wall time."""
    press_prefill(model, ids[:, :256], None)
    press = Config(name, ratio, 0).build() if name != "none" else None
    clear_scores()
    remove = labelled(model, press)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            press_prefill(model, ids, press)
            wall = time.perf_counter() - start
    finally:
        remove()
    table: dict = defaultdict(float)
    ops: dict = defaultdict(float)
    for event in prof.events():
        if event.name.startswith(("phase::", "kind::", "fused::")):
            continue
        phase, kind = kind_of(event)
        table[phase, kind] += event.self_cpu_time_total / 1e6
        ops[f"{phase}/{kind}/{event.name}"] += event.self_cpu_time_total / 1e6
    return {"press": name, "wall_s": wall, "seconds": {f"{p}/{k}": s for (p, k), s in sorted(table.items())},
            "operations": {key: round(s, 4) for key, s in sorted(ops.items(), key=lambda kv: -kv[1]) if s >= 0.01}}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Where a KVzip prefill's time goes, by operation ({meta['device']}, n = {meta['n']}, "
             f"r = {meta['ratio']:g}, {meta['threads']} thread)", "",
             f"Command: `{meta['command']}`", "",
             "Seconds of each operation's own time (torch.profiler, self CPU time) by phase and kind "
             "(evaluation/bench/speed/profile_ops.py); the profiler adds its own overhead, so the sum exceeds "
             "the wall time a little. Parts under 0.05 s are left out.", ""]
    for row in rows:
        lines += [f"## {row['press']} (wall {row['wall_s']:.2f} s under the profiler)", "",
                  "| phase | kind | s |", "| :--- | :--- | ---: |"]
        totals: dict = defaultdict(float)
        for key, s in row["seconds"].items():
            totals[key.split("/")[0]] += s
        for key, s in sorted(row["seconds"].items(), key=lambda kv: (PHASES + ("other",)).index(kv[0].split("/")[0])
                             if kv[0].split("/")[0] in PHASES + ("other",) else 9):
            if s >= 0.05:
                phase, kind = key.split("/")
                lines.append(f"| {phase} | {kind} | {s:.2f} |")
        lines += ["", "Per phase: " + ", ".join(f"{p} {s:.2f} s" for p, s in totals.items() if s >= 0.05), ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m evaluation.bench.speed.profile_ops", description=__doc__.split("\n")[0])
    p.add_argument("--presses", nargs="+", required=True)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = common.load(None)
    ids = common.context_ids(tokenizer, args.length, device=model.device)
    with torch.no_grad():
        rows = [profile_press(model, ids, name, args.ratio) for name in args.presses]
    import sys
    meta = {"device": "cpu" if model.device.type == "cpu" else torch.cuda.get_device_name(model.device),
            "n": args.length, "ratio": args.ratio, "threads": args.threads,
            "command": "python -m evaluation.bench.speed.profile_ops " + " ".join((argv or sys.argv[1:]))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "profile.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
