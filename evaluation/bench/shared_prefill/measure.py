"""The shared-prefill bench's three loops: the naive pipeline, shared prefill, shared prefill + batched decoding."""

from __future__ import annotations

from kvpress import KVPressTextGenerationPipeline

from evaluation.bench.common import Stopwatch
from evaluation.engine import Compressed, Prefill, generate_batch
from evaluation.engine.runner import Config

PRESSES = ["snapkv", "tova", "knorm", "streaming_llm", "prob_snapkv", "prob_knorm", "prob_min_h", "topk_min_h"]


def measure(model, tokenizer, rows, presses, ratio) -> list[dict]:
    """One dict per example: the three wall times, the speed-ups and whether the predictions match."""
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    out = []
    for row in rows:
        configs = [Config(name, ratio, 0) for name in presses]
        max_new = int(row["max_new_tokens"])
        with Stopwatch(model.device) as naive_watch:
            naive = [pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                          press=cfg.build(), max_new_tokens=max_new)["answer"] for cfg in configs]
        with Stopwatch(model.device) as shared_watch:
            inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)
            context_ids = inputs["context_ids"].to(model.device)
            question_ids = inputs["questions_ids"][0].to(model.device)
            n = context_ids.shape[1]
            shared = Prefill(model, context_ids, [cfg.build() for cfg in configs])
            ours = [pipe.generate_answer(question_ids, shared.compress(cfg.build()), n, max_new) for cfg in configs]
        del shared
        with Stopwatch(model.device) as batched_watch:
            shared = Prefill(model, context_ids, [cfg.build() for cfg in configs])
            items = [Compressed.take(shared.compress(cfg.build()), shared.layers) for cfg in configs]
            batched = generate_batch(model, tokenizer, question_ids, items, n, max_new)
        del shared, items
        t_naive, t_shared, t_batched = naive_watch.wall, shared_watch.wall, batched_watch.wall
        out.append(dict(example_id=row["example_id"], task=row["task"], context_tokens=n, configs=len(configs),
                        naive_s=t_naive, shared_s=t_shared, batched_s=t_batched, speedup=t_naive / t_shared,
                        speedup_batched=t_naive / t_batched, identical=naive == ours,
                        identical_batched=naive == batched))
    return out
