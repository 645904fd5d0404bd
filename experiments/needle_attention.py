"""Where the attention of the question's last token goes on a compressed cache: to the needle's
tokens, to the other kept entries, to the virtual (summary) entries, or to the question itself.

For each NIAH example and press: one compressed prefill (``Prefill.compress``), then the question is
fed on that cache with a pre-hook on every attention module that keeps its input; the last query
of each layer (after RoPE) is scored against the layer's stored keys plus the correction's bias (the
press's public state: ``correction.bias_of``), softmax over [stored prefix | question], averaged over
heads. Stored real entries are matched to prefix positions by their keys; the c last stored entries
of a summary press are its virtual ones. Written per layer to ``<out>/needle_attention.jsonl``, with
a per-press table (mean over layers and examples) in ``<out>/needle_attention.md``.

``python -m experiments.needle_attention --presses keydiff keydiff_sum4 --ratios 0.75 --out runs/needle-attention``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from kvpress import KVPressTextGenerationPipeline

from evaluation.engine import Prefill
from evaluation.tasks.ruler.needles import needle_positions
from experiments.decompose.steps import DEV_TASKS
from kvpress_prob import get_press, load_model
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.proposals.attention import rope_queries
from kvpress_prob.presses.summary import SummaryPress, SummarySamplingPress


def _row_match(full: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """(H, S) long: the prefix position of each stored row (-1: no prefix row has that key)."""
    equal = (held[:, :, None, :] == full[:, None, :, :]).all(-1)  # (H, S, n)
    return torch.where(equal.any(-1), equal.float().argmax(-1), torch.full(equal.shape[:2], -1))


@torch.no_grad()
def shares(model, prefill: Prefill, press, question_ids: torch.Tensor, needles: list[int]) -> list[dict]:
    """Per layer: the last question query's attention share of the needle, the other kept entries,
    the virtual entries and the question tokens (head-averaged)."""
    cache = prefill.compress(press)
    n_virtual = press.summary.n_virtual if isinstance(press, (SummaryPress, SummarySamplingPress)) else 0
    layers = language_model(model).layers
    seen = {}

    def keep_input(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["hidden_states"][:, -1:], tuple(x[:, -1:] for x in kwargs["position_embeddings"]))

    handles = [layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in layers]
    stored = [layer.keys.shape[2] for layer in cache.layers]
    biases = [correction.bias_of(layer.self_attn, cache) for layer in layers]
    n = prefill.context_ids.shape[1]
    try:
        model(input_ids=question_ids, past_key_values=cache,
              position_ids=torch.arange(n, n + question_ids.shape[1])[None])
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    needle = torch.tensor(needles)
    for idx, layer in enumerate(layers):
        module = layer.self_attn
        hidden, position = seen[idx]
        q = rope_queries(module, hidden, position)[0, :, 0].float()  # (H_q, d)
        keys = cache.layers[idx].keys[0].float()  # (H_kv, S + T, d)
        hq, hkv = q.shape[0], keys.shape[0]
        k = keys.repeat_interleave(hq // hkv, dim=0)  # (H_q, S + T, d)
        logits = (k @ q[:, :, None])[..., 0] * module.scaling  # (H_q, S + T)
        s = stored[idx]
        if biases[idx] is not None:
            logits[:, :s] += biases[idx][0].float().repeat_interleave(hq // hkv, dim=0)
        p = logits.softmax(-1)
        real = s - n_virtual
        position_of = _row_match(prefill.keys[idx][0], cache.layers[idx].keys[0, :, :real])  # (H_kv, real)
        on_needle = torch.isin(position_of, needle).repeat_interleave(hq // hkv, dim=0)  # (H_q, real)
        rows.append({"layer": idx, "needle": float((p[:, :real] * on_needle).sum(-1).mean()),
                     "kept": float((p[:, :real] * ~on_needle).sum(-1).mean()),
                     "virtual": float(p[:, real:s].sum(-1).mean()), "question": float(p[:, s:].sum(-1).mean())})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.needle_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presses", nargs="+", required=True, help="registry names")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.75], help="compression ratios (default: [0.75])")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling presses (default: 0)")
    parser.add_argument("--context-length", type=int, default=1024, help="RULER context tokens (default: 1024)")
    parser.add_argument("--data-seed", type=int, default=0, help="0: development split (default: 0)")
    parser.add_argument("--n-examples", type=int, default=8, help="examples over the tasks (default: 8)")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    from evaluation.tasks.ruler.offline import generate_ruler

    model, tokenizer = load_model()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    frame = generate_ruler(tokenizer, args.context_length, args.n_examples, args.data_seed, tasks=DEV_TASKS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for _, row in frame.iterrows():
        if not row["task"].startswith("niah"):
            continue
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
        needles = sorted({p for ps in needle_positions(tokenizer, inputs["context_ids"], list(row["answer"])) for p in ps})
        prefill = Prefill(model, inputs["context_ids"])
        for name in args.presses:
            for ratio in args.ratios:
                press = get_press(name, ratio, **({"seed": args.seed} if hasattr(get_press(name, 0.5), "seed") else {}))
                for r in shares(model, prefill, press, inputs["questions_ids"][0], needles):
                    records.append({"example_id": row["example_id"], "press": name, "compression_ratio": ratio, **r})
    (out / "needle_attention.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["# Attention of the question's last token (mean over layers, heads and NIAH examples)", "",
             "| press | r | needle | other kept | virtual | question |", "|---|---|---|---|---|---|"]
    for name in args.presses:
        for ratio in args.ratios:
            sel = [r for r in records if r["press"] == name and r["compression_ratio"] == ratio]
            m = {key: np.mean([r[key] for r in sel]) for key in ("needle", "kept", "virtual", "question")}
            lines.append(f"| {name} | {ratio:g} | {m['needle']:.4f} | {m['kept']:.3f} | {m['virtual']:.3f} | {m['question']:.3f} |")
    (out / "needle_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
