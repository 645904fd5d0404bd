"""Which stream positions a compressed cache holds: each cached key of a layer matched to the nearest key
of the full cache of the same stream (on layer 0 a key depends only on its token and position, so the
match is exact up to float rounding). The diagnostic behind docs/research/README.md's kvpress finding:

    python -m evaluation.tasks.streaming.positions --out kvpress-sinks.json

feeds the first dev stream's first 512 tokens (prefill 128, then chunks of 32, compressing every 32
tokens back to 128 entries) under kvpress's StreamingLLMPress inside DecodingPress, the order-keeping
sink-and-window press and TOVA; records the layer-0 positions each holds after 8 chunks and the NLL
increase and KL of the whole 512 tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PRESSES = ("kvpress_streaming_llm", "streaming_llm", "tova")


def positions_held(keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """Positions (H_kv, k) of the cached ``keys`` (1, H_kv, k, d) in ``full_keys`` (1, H_kv, n, d), in the
    cache's order, by the nearest full key of the same head."""
    distance = torch.cdist(keys[0].float(), full_keys[0].float())  # (H_kv, k, n)
    return distance.argmin(dim=-1)


def sink_check(model, ids: torch.Tensor, budget: int = 128, chunk: int = 32, chunks: int = 8) -> dict:
    """Layer-0 positions held after ``chunks`` chunks (per KV head, sorted) and the scores of all of ``ids``."""
    from evaluation.tasks.streaming import metrics
    from evaluation.tasks.streaming.drive import Schedule, feed, full_logits
    from evaluation.tasks.streaming.presses import DETERMINISTIC

    short = Schedule(n=budget + chunk * chunks + 1, budget=budget, chunk=chunk, interval=chunk)
    whole = Schedule(n=ids.shape[1], budget=budget, chunk=chunk, interval=chunk)
    full_keys = feed(model, ids[:, :short.n], short)["cache"].layers[0].keys
    reference = full_logits(model, ids, whole)
    out = {"budget": budget, "chunk": chunk, "chunks": chunks, "tokens": ids.shape[1], "presses": {}}
    for name in PRESSES:
        cache = feed(model, ids[:, :short.n], short, DETERMINISTIC[name](short, 0, 0))["cache"]
        held = positions_held(cache.layers[0].keys, full_keys).sort(dim=-1).values
        parts = []

        def score(start, logits):
            offset = start - whole.score_from
            parts.append(metrics.token_scores(reference[offset:offset + len(logits)], logits,
                                              ids[0, start + 1:start + 1 + len(logits)].to(logits.device)))

        feed(model, ids, whole, DETERMINISTIC[name](whole, 0, 0), score)
        held_sinks = [sorted(set(range(4)) & set(h.tolist())) for h in held]
        out["presses"][name] = {"sinks_held_per_head": held_sinks, "positions_held_head0": held[0].tolist(),
                                **metrics.summary(parts)}
    return out


def main(argv=None) -> None:
    from evaluation.tasks.streaming.streams import streams
    from kvpress_prob.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model, tokenizer = load_model()
    stream = streams(tokenizer, "dev", args.tokens, max_streams=1)[0]
    result = {"stream": stream.stream_id, "split": "dev"} | sink_check(model, stream.ids)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, r in result["presses"].items():
        print(f"{name}: sinks held on layer 0 (per KV head) {r['sinks_held_per_head']}, "
              f"NLL increase {r['nll_increase']:.4f}, KL {r['kl']:.4f} over {r['n_scored']} tokens")


if __name__ == "__main__":
    main()
