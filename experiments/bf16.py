"""bf16 correction bias: does storing the SNIS log-weights in bfloat16 change the model's output
more than the sampling itself does? (docs/method.md, "Correction")

On the embedded model in bfloat16 on the CPU, every RULER example is prefilled once (the engine's
``Prefill``); for each prob press, ratio and seed the same draw is stored twice, with the bias in
the keys' dtype (bfloat16: a log-weight of 5.3 is rounded by 0.0125) and in float32
(``SamplingPress(bias_dtype="float32")``; the corrected attention then adds it to the bf16 logits in
float32), and the question + gold answer are scored teacher-forced on each (the engine's
``teacher_forced``). The draw is evicted once, with the float32 bias; the bf16 copy is its cast,
which is what ``evict`` stores by default (asserted on the first draw). Reported, as KL(p || q) per next-token position averaged over question and
answer (nats):

- ``precision``: KL(float32 bias || bf16 bias), the same draw: the effect of the rounding;
- ``seeds``: KL between two seeds of the same press and ratio (bf16 bias), over the seed pairs: the
  sampling noise the rounding is compared with;
- ``compression``: KL(full cache || bf16 bias): how far the compressed cache is from the full one.

The bias is kept in higher precision only if ``precision`` reaches ``seeds`` (the verdict line).

    python -m experiments.bf16            # 3 examples x 4 presses x 3 ratios x 3 seeds at 1024 tokens
    python -m experiments.bf16 --quick    # 1 example, 2 presses, r = 0.5, 2 seeds
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evaluation.bench import common

PRESSES = ("prob_snapkv", "prob_tova", "prob_knorm", "prob_min_h")
RATIOS = (0.25, 0.5, 0.75)
SEEDS = (0, 1, 2)
TASKS = ("niah_single_2", "niah_multikey_1", "vt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="1 example, 2 presses, r = 0.5, 2 seeds")
    parser.add_argument("--out", default="results/bench", help="output root; files go to <out>/bf16/")
    parser.add_argument("--model", default=None, help="HF id or path (None: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--context-length", type=int, default=1024, help="RULER context tokens")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help="RULER tasks, one example each")
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), help="prob presses")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS), help="compression ratios")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="sampler seeds")


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(p) || softmax(q)) per row, nats, float64."""
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def inputs(pipe, row) -> tuple[torch.Tensor, torch.Tensor]:
    """(context_ids (1, n), question + gold answer ids (1, T)) as the kvpress pipeline builds them."""
    encoded = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
    answer = row["answer"][0] if isinstance(row["answer"], (list, tuple, np.ndarray)) else str(row["answer"])
    prefix = row["answer_prefix"]
    sep = "" if (not prefix or prefix[-1].isspace()) else " "
    answer_ids = pipe.tokenizer.encode(sep + str(answer), add_special_tokens=False, return_tensors="pt")
    question_ids = encoded["questions_ids"][0]
    return encoded["context_ids"], torch.cat([question_ids, answer_ids.to(question_ids.dtype)], dim=1)


@torch.no_grad()
def run(args) -> dict:
    from kvpress import KVPressTextGenerationPipeline

    from evaluation.tasks.ruler.offline import generate_ruler
    from evaluation.engine import Prefill, teacher_forced
    from kvpress_prob import get_press, load_model
    from kvpress_prob.correction import bias as correction
    from kvpress_prob.presses.sampling import language_model

    if args.quick:
        args.tasks, args.presses, args.ratios, args.seeds = args.tasks[:1], ["prob_snapkv", "prob_min_h"], [0.5], [0, 1]
    info = common.machine_info()
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.bfloat16)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    frame = generate_ruler(tokenizer, args.context_length, len(args.tasks), 0, tasks=list(args.tasks))
    rows, rounding, checked = [], [], False
    modules = [layer.self_attn for layer in language_model(model).layers]
    for _, example in frame.iterrows():
        context_ids, continuation = inputs(pipe, example)
        n = context_ids.shape[1]
        prefill = Prefill(model, context_ids, [get_press(name, ratio) for name, ratio in itertools.product(args.presses, args.ratios)])
        full, _ = teacher_forced(model, prefill.compress(None), continuation, n)
        for name, ratio in itertools.product(args.presses, args.ratios):
            logits = {}
            for seed in args.seeds:
                # one draw, stored twice: evict keeps the float32 bias; the keys' dtype is its cast,
                # bit for bit what evict stores by default (checked once below)
                default = None if checked else prefill.compress(get_press(name, ratio, seed=seed))
                press = get_press(name, ratio, seed=seed, bias_dtype="float32")
                caches = {"float32": prefill.compress(press)}
                caches["keys"] = copy.deepcopy(caches["float32"])
                for module in modules:
                    bias = correction.bias_of(module, caches["float32"])
                    correction.set_bias(module, bias.to(caches["keys"].layers[module.layer_idx].keys.dtype), caches["keys"])
                if default is not None:
                    assert all(torch.equal(correction.bias_of(m, default), correction.bias_of(m, caches["keys"]))
                               for m in modules), "the cast bias differs from evict's own"
                    checked = True
                rounding.append(rounding_error(press))
                for dtype, cache in caches.items():
                    with common.Stopwatch() as watch:
                        logits[seed, dtype], _ = teacher_forced(model, cache, continuation, n)
                    rows.append({"example": example["example_id"], "press": name, "ratio": ratio, "seed": seed,
                                 "bias_dtype": dtype, "realised_ratio": press.stats["realised_ratio"],
                                 "forward_cpu_s": watch.cpu,
                                 "kl_full": float(kl(full, logits[seed, dtype]).mean())})
            for seed in args.seeds:
                rows.append({"example": example["example_id"], "press": name, "ratio": ratio, "seed": seed,
                             "kind": "precision", "kl": float(kl(logits[seed, "float32"], logits[seed, "keys"]).mean()),
                             "top1": float((logits[seed, "float32"].argmax(-1) == logits[seed, "keys"].argmax(-1))
                                           .double().mean())})
            for a, b in itertools.combinations(args.seeds, 2):
                rows.append({"example": example["example_id"], "press": name, "ratio": ratio, "seed": f"{a}-{b}",
                             "kind": "seeds", "kl": float(kl(logits[a, "keys"], logits[b, "keys"]).mean()),
                             "top1": float((logits[a, "keys"].argmax(-1) == logits[b, "keys"].argmax(-1))
                                           .double().mean())})
    info["loadavg_end"] = common.loadavg()
    records = pd.DataFrame(rows)
    return {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "machine": info,
            "seconds": time.perf_counter() - start, "records": records, "rounding": rounding}


def rounding_error(press) -> dict:
    """The bf16 rounding of this draw's kept log-weights: max and mean |bf16(w) - w| and max |w|."""
    w = press.last_draw.log_weight
    w = w[torch.isfinite(w)] / press.temperature
    err = (w.to(torch.bfloat16).float() - w).abs()
    return {"max_abs_log_weight": float(w.abs().max()), "max_error": float(err.max()), "mean_error": float(err.mean())}


def summarise(result: dict) -> tuple[pd.DataFrame, dict]:
    records = result["records"]
    pairs = records.dropna(subset=["kind"])
    table = pairs.pivot_table(index=["press", "ratio"], columns="kind", values="kl", aggfunc="mean")
    agreement = pairs.pivot_table(index=["press", "ratio"], columns="kind", values="top1", aggfunc="mean")
    table["precision / seeds"] = table["precision"] / table["seeds"]
    table["top1 precision"] = agreement["precision"]
    table["top1 seeds"] = agreement["seeds"]
    scored = records[records["kind"].isna()]
    table["compression"] = scored[scored["bias_dtype"] == "keys"].groupby(["press", "ratio"])["kl_full"].mean()
    speed = scored.groupby("bias_dtype")["forward_cpu_s"].median()
    worst = float(table["precision / seeds"].max())
    overall = {
        "precision_kl_mean": float(pairs[pairs["kind"] == "precision"]["kl"].mean()),
        "seeds_kl_mean": float(pairs[pairs["kind"] == "seeds"]["kl"].mean()),
        "worst_cell_ratio": worst,
        "forward_cpu_s_median": {k: float(v) for k, v in speed.items()},
        "max_log_weight": max(r["max_abs_log_weight"] for r in result["rounding"]),
        "max_rounding": max(r["max_error"] for r in result["rounding"]),
        "mean_rounding": float(np.mean([r["mean_error"] for r in result["rounding"]])),
        "verdict": ("float32: the rounding's KL reaches the sampling noise" if worst >= 1.0 else
                    "keys' dtype: the rounding's KL stays below the sampling noise in every cell"),
    }
    return table.reset_index(), overall


def markdown(result: dict, table: pd.DataFrame, overall: dict) -> str:
    s = result["settings"]
    shown = table.copy()
    for column in ("precision", "seeds", "compression"):
        shown[column] = shown[column].map(lambda x: f"{x:.2e}")
    for column in ("precision / seeds", "top1 precision", "top1 seeds"):
        shown[column] = shown[column].map(lambda x: f"{x:.3f}")
    return (
        "# bf16 correction bias: rounding vs sampling noise\n\n"
        f"`python -m experiments.bf16{' --quick' if s['quick'] else ''}`: the embedded model in bfloat16 on "
        f"the CPU, RULER at {s['context_length']} tokens ({', '.join(s['tasks'])}, one example each), presses "
        f"{', '.join(s['presses'])}, r = {', '.join(map(str, s['ratios']))}, seeds {', '.join(map(str, s['seeds']))}; "
        f"{result['seconds']:.0f} s.\n\n"
        "KL(p || q) per next-token position over question + gold answer, teacher-forced, mean (nats): "
        "**precision** = KL(float32 bias || bf16 bias) on the same draw; **seeds** = KL between two seeds "
        "(bf16 bias), the sampling noise; **compression** = KL(full cache || bf16 bias). top1 = agreement "
        "of the argmax tokens.\n\n"
        + common.markdown_table(shown, index=False) + "\n\n"
        f"Kept log-weights up to {overall['max_log_weight']:.2f} in magnitude; bf16 rounds them by up to "
        f"{overall['max_rounding']:.4f} ({overall['mean_rounding']:.4f} on average). Mean KL: precision "
        f"{overall['precision_kl_mean']:.2e}, seeds {overall['seeds_kl_mean']:.2e}; largest precision / seeds "
        f"ratio of a cell {overall['worst_cell_ratio']:.3g}. Median CPU seconds of one teacher-forced forward: "
        + ", ".join(f"{k} bias {v:.3f}" for k, v in overall["forward_cpu_s_median"].items()) + ".\n\n"
        f"**Verdict: {overall['verdict']}.**\n\n"
        "Machine:\n" + common.machine_markdown(result["machine"])
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bf16", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    result = run(args)
    table, overall = summarise(result)
    out = Path(args.out) / "bf16"
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "bf16.json", {**{k: v for k, v in result.items() if k != "records"},
                                          "summary": table, "overall": overall, "records": result["records"]})
    text = markdown(result, table, overall)
    common.write_markdown(out / "bf16.md", text)
    print(text)


if __name__ == "__main__":  # python -m experiments.bf16
    main()
