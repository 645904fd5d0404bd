"""Attention-error bench: which attention-level measure predicts the answer, with no decoding.

For each example (RULER, the chat-formatted context, then the question and the gold answer) and
each registry press, ratio and seed, the context is compressed (``engine.Prefill.compress``) and
the question and answer are teacher-forced on it (``engine.teacher_forced``). Recorded per
configuration (``records.jsonl``, one line per example, press, ratio and seed; resumable):

- ``kl``, ``kl_answer``: KL(full || compressed) of the next-token distributions, over every row and
  over the rows that predict the answer (as the fidelity bench);
- ``layer_err``: per layer, ||O - O_ref||_F / ||O_ref||_F of the attention output before o_proj
  (every query head) at the question's rows; ``mean_layer_err`` its mean over layers;
- ``needle_err``: the per-(layer, query head) relative errors at the question's rows, averaged
  with weights m_{l,h}, the mass the full cache's attention from the question's rows puts on the
  needle span (the context tokens spelling the answer); ``needle_top_err``: the plain mean over
  the ``--top-heads`` heads of largest m; ``needle_last_err``: ``needle_err`` at the last question
  row only (the row that predicts the first answer token).

Per configuration ``retention.jsonl`` holds what needs no teacher forcing: ``needle_recall``, the
share of each head's full-cache attention to the needle that falls on entries the cache kept,
averaged with weights m_{l,h}; ``needle_top_recall`` (the top heads by m); ``needle_whole`` (the
m-weighted share of heads that kept every needle token). ``--retention-only`` measures only these.

Per (example, sampling press) ``proposals.jsonl`` also holds the proposal's shape: its effective
support exp(H(pi)) / n and its needle share sum_{needle} pi against the uniform share |needle| / n,
averaged over layers and KV heads.

``python -m experiments.attention --out results/archive/bench/attention/dev-1024 --presses ... --scores <results.jsonl> ...``
then correlates each measure with the decoded score and the KL across presses
(``experiments.attention.report``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from evaluation.engine import Prefill, teacher_forced
from evaluation.engine.runner import Config
from evaluation.metrics.survival import kept_positions
from evaluation.store.results import write_atomic
from evaluation.tasks.ruler.needles import needle_positions
from experiments.decompose.steps import DEV_TASKS
from kvpress_prob import SamplingPress
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.names.registry import PRESSES, is_sampling


def capture_heads(model, cache, continuation_ids: torch.Tensor, n_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-force ``continuation_ids`` on ``cache``: (logits (T, V), per-head attention outputs
    before o_proj (L, T, H_q, d)), read by a pre-hook on every layer's o_proj (removed after)."""
    modules = [layer.self_attn for layer in language_model(model).layers]
    outputs: dict[int, torch.Tensor] = {}

    def hook_for(index: int, module):
        def hook(_, args):
            outputs[index] = args[0][0].detach().float().clone()  # (T, H_q * d)
        return module.o_proj.register_forward_pre_hook(hook)

    handles = [hook_for(i, m) for i, m in enumerate(modules)]
    try:
        logits, _ = teacher_forced(model, cache, continuation_ids, n_context)
    finally:
        for handle in handles:
            handle.remove()
    heads, dim = model.config.num_attention_heads, modules[0].head_dim
    stacked = torch.stack([outputs[i] for i in range(len(modules))])  # (L, T, H_q * d)
    return logits, stacked.view(len(modules), stacked.shape[1], heads, dim)


@torch.no_grad()
def needle_attention(model, prefill: Prefill, continuation_ids: torch.Tensor, rows: slice,
                     needle: list[int]) -> torch.Tensor:
    """a (L, H_q, |needle|): the full cache's attention from the question's ``rows`` to each
    ``needle`` position, mean over the rows (one eager teacher-forced pass; the implementation is
    restored). m = a.sum(-1) is each head's needle mass."""
    modules = [layer.self_attn for layer in language_model(model).layers]
    weights: dict[int, torch.Tensor] = {}

    def hook_for(index: int, module):
        def hook(_, args, output):
            weights[index] = output[1][0, :, rows][..., needle].mean(1).float()  # (H_q, |needle|)
        return module.register_forward_hook(hook)

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    handles = [hook_for(i, m) for i, m in enumerate(modules)]
    try:
        teacher_forced(model, prefill.compress(None), continuation_ids, prefill.context_ids.shape[1])
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return torch.stack([weights[i] for i in range(len(modules))])


def kl_rows(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per row, nats, float64, clamped at 0."""
    p = torch.log_softmax(reference_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def head_errors(heads: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Relative error per (layer, head) over the rows of (L, T, H, d) tensors: (L, H)."""
    num = (heads.double() - reference.double()).pow(2).sum((1, 3)).sqrt()
    return num / reference.double().pow(2).sum((1, 3)).sqrt().clamp_min(1e-300)


def measures(heads: torch.Tensor, reference: torch.Tensor, mass: torch.Tensor | None, top_heads: int) -> dict:
    """The attention-level measures of one compressed cache (module docstring). heads and
    reference (L, R, H, d) at the question's R rows; mass (L, H) or None (no needle in the context)."""
    diff = (heads.double() - reference.double()).flatten(1).norm(dim=1)
    layer_err = (diff / reference.double().flatten(1).norm(dim=1).clamp_min(1e-300)).tolist()
    out = {"layer_err": layer_err, "mean_layer_err": sum(layer_err) / len(layer_err),
           "needle_err": None, "needle_top_err": None, "needle_last_err": None}
    if mass is not None and float(mass.sum()) > 0:
        err, last = head_errors(heads, reference), head_errors(heads[:, -1:], reference[:, -1:])
        w = mass.double() / mass.double().sum()
        top = mass.flatten().topk(min(top_heads, mass.numel())).indices
        out |= {"needle_err": float((w * err).sum()), "needle_top_err": float(err.flatten()[top].mean()),
                "needle_last_err": float((w * last).sum())}
    return out


def retention(attention: torch.Tensor, keep: torch.Tensor, needle: list[int], top_heads: int) -> dict:
    """How much of the needle-reading attention the cache still holds. attention (L, H_q, |needle|)
    from ``needle_attention``; keep (L, H_kv, n) bool, the positions each KV head kept.

    For head (l, h): recall = sum over kept needle positions of a / sum of a (the share of its needle
    attention that still has its entry), whole = 1 if every needle token is kept. ``needle_recall``
    and ``needle_whole`` average them with weights m_{l,h} = sum a; ``needle_top_recall`` is the plain
    mean of recall over the ``top_heads`` heads of largest m."""
    heads = attention.shape[1]
    kept = keep[:, :, needle].repeat_interleave(heads // keep.shape[1], dim=1).double()  # (L, H_q, |needle|)
    a = attention.double()
    mass = a.sum(-1)  # (L, H_q)
    recall = (a * kept).sum(-1) / mass.clamp_min(1e-300)
    whole = kept.prod(-1)
    w = mass / mass.sum().clamp_min(1e-300)
    top = mass.flatten().topk(min(top_heads, mass.numel())).indices
    return {"needle_recall": float((w * recall).sum()), "needle_whole": float((w * whole).sum()),
            "needle_top_recall": float(recall.flatten()[top].mean())}


def proposal_shape(prefill: Prefill, press: SamplingPress, needle: list[int]) -> dict:
    """Effective support exp(H(pi)) / n and needle share of the press's proposals, mean over layers
    and KV heads (and the uniform share |needle| / n)."""
    prefill.compress(press)  # the engine's replay (sets what the scorers read); its proposals are memoised
    pi = torch.stack(list(prefill.proposals_of(press).values()))[:, 0].double()  # (L, H_kv, n)
    n = pi.shape[-1]
    entropy = -(pi * torch.log(pi.clamp_min(1e-300))).sum(-1)
    share = pi[..., needle].sum(-1) if needle else None
    return {"effective_support": float((entropy.exp() / n).mean()),
            "needle_share": None if share is None else float(share.mean()),
            "uniform_share": len(needle) / n}


def configs(presses, ratios, seeds) -> list[Config]:
    for name in presses:
        if name not in PRESSES:
            raise SystemExit(f"unknown press {name!r}; valid names: {', '.join(sorted(PRESSES))}")
    return [Config(p, r, s) for p in presses for r in ratios for s in (seeds if is_sampling(p) else seeds[:1])]


def run(args) -> None:
    from kvpress import KVPressTextGenerationPipeline

    from evaluation.bench.fidelity.measure import build_inputs, load_examples
    from kvpress_prob.models import load_model

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, shapes, kept_file = out / "records.jsonl", out / "proposals.jsonl", out / "retention.jsonl"

    def keys_of(path: Path) -> set:
        return {(r["example_id"], r["press"], r["compression_ratio"], r["seed"])
                for r in map(json.loads, path.read_text().splitlines())} if path.exists() else set()

    done, retained = keys_of(records), keys_of(kept_file)
    shaped = {(r["example_id"], r["press"]) for r in map(json.loads, shapes.read_text().splitlines())} \
        if shapes.exists() else set()
    model, tokenizer = load_model(args.model)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    frame = load_examples(tokenizer, args.context_length, args.n_examples, args.data_seed, args.tasks)
    todo_all = configs(args.presses, args.ratios, args.seeds)
    for _, row in frame.iterrows():
        if args.proposals_only:
            todo = [c for c in todo_all if (row["example_id"], c.press) not in shaped]
        elif args.retention_only:
            todo = [c for c in todo_all if (row["example_id"], c.press, c.compression_ratio, c.seed) not in retained]
        else:
            todo = [c for c in todo_all if (row["example_id"], c.press, c.compression_ratio, c.seed) not in done]
        if not todo:
            continue
        start = time.perf_counter()
        context_ids, continuation_ids, n_question = build_inputs(pipe, tokenizer, row, model.device)
        n = context_ids.shape[1]
        needles = needle_positions(tokenizer, context_ids, [str(a) for a in row["answer"]])
        needle = sorted({p for found in needles for p in found})
        rows = slice(0, n_question)  # the question's rows (chat template and answer prefix included)
        prefill = Prefill(model, context_ids)
        if not args.proposals_only:
            attention = needle_attention(model, prefill, continuation_ids, rows, needle) if needle else None
            mass = None if attention is None else attention.sum(-1)
        if not (args.proposals_only or args.retention_only):
            ref_logits, ref_heads = capture_heads(model, prefill.compress(None), continuation_ids, n)
        answer_rows = slice(n_question - 1, continuation_ids.shape[1] - 1)
        lines, shape_lines, kept_lines = [], [], []
        for cfg in todo:
            press = cfg.build()
            if isinstance(press, SamplingPress) and (row["example_id"], cfg.press) not in shaped:
                shaped.add((row["example_id"], cfg.press))
                shape_lines.append({"example_id": row["example_id"], "task": row["task"], "press": cfg.press,
                                    **proposal_shape(prefill, press, needle)})
            if args.proposals_only:
                continue
            cache = prefill.compress(press)
            key = {"example_id": row["example_id"], "task": row["task"], "press": cfg.press,
                   "compression_ratio": cfg.compression_ratio, "seed": cfg.seed}
            if attention is not None and (row["example_id"], cfg.press, cfg.compression_ratio, cfg.seed) not in retained:
                kept_lines.append({**key, **retention(attention, kept_positions(prefill, cache, press), needle,
                                                      args.top_heads)})
            if args.retention_only:
                continue
            logits, heads = capture_heads(model, cache, continuation_ids, n)
            kl = kl_rows(ref_logits, logits)
            lines.append({"example_id": row["example_id"], "task": row["task"], "press": cfg.press,
                          "compression_ratio": cfg.compression_ratio, "seed": cfg.seed, "n_context": n,
                          "needle_tokens": len(needle), "kl": float(kl.mean()), "kl_answer": float(kl[answer_rows].mean()),
                          **measures(heads[:, rows], ref_heads[:, rows], mass, args.top_heads)})
        if lines:
            with records.open("a") as f:  # one example at a time: a killed run loses at most one example
                f.write("".join(json.dumps(line) + "\n" for line in lines))
        for path, items in ((shapes, shape_lines), (kept_file, kept_lines)):
            if items:
                with path.open("a") as f:
                    f.write("".join(json.dumps(line) + "\n" for line in items))
        print(f"[attention] {row['example_id']}: {len(todo)} configurations in {time.perf_counter() - start:.0f} s",
              flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/archive/bench/attention/dev-1024", help="output folder")
    p.add_argument("--model", default=None, help="HF id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--data-seed", type=int, default=0, help="RULER data seed (0: the development split)")
    p.add_argument("--n-examples", type=int, default=8, help="examples, spread over --tasks")
    p.add_argument("--tasks", nargs="+", default=DEV_TASKS)
    p.add_argument("--presses", nargs="+", default=["tova", "keydiff", "topk_tova_block8", "prob_tova_block8_priority"])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5, 0.75, 0.9])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--top-heads", type=int, default=16, help="heads of largest needle mass in needle_top_err")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--scores", nargs="*", default=[],
                   help="runner results.jsonl files with the decoded scores of the same examples (for the report)")
    p.add_argument("--proposals-only", action="store_true",
                   help="only the proposal shape of the sampling presses (proposals.jsonl), no teacher forcing")
    p.add_argument("--retention-only", action="store_true",
                   help="only the needle retention of each cache (retention.jsonl), no teacher forcing")
    p.add_argument("--report", action="store_true", help="only write the report from what is in --out")
    return p


def main(argv: list[str] | None = None) -> None:
    from experiments.attention import report as attention_report

    args = parser().parse_args(argv)
    if not args.report:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out) / "settings.json", json.dumps(vars(args), indent=2))
        run(args)
    attention_report.write(Path(args.out), args.scores)
