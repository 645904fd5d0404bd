"""What the compounded weights look like while a stream is decoded: their spread after R rounds,
and the share of the attention that the oldest survivors carry against the share the full cache gives the
same positions.

    python -m experiments.stream_weights --streams 2 --budget 256 --rounds 4 16 64 --out runs/stream-weights

For each press (ours: the positions of the entries are followed through every round) and the full cache,
a stream is fed by the benchmark's schedule (chunk 32, a round every 32 tokens). At the forward that
follows round R of a layer, for each layer and KV head:

- ``max_w``: the largest weight e^bias of an entry held (1 for a press without correction);
- ``ess``: (sum w)^2 / (k sum w^2) over the k entries held, the effective sample size over k (1: equal weights);
- ``sum_w / seen``: the weights' sum over the tokens fed before the chunk (the Horvitz-Thompson count);
- ``old_share``: the attention the chunk's queries (averaged over its queries and query heads) pay, with
  the bias, to the oldest survivors: the entries of the prefill (positions 4 .. budget - 1, sinks
  excluded), which have been through every round; ``full old share`` the same for the full cache at the
  same forward and positions.

Values are medians over layers and heads, then means over streams. One process, CPU, one thread is enough.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

N_SINK = 4


class Watch:
    """Forward hooks that follow positions and measure weights and attention at the chosen rounds."""

    def __init__(self, model, rounds_wanted: list[int], chunk: int, budget: int):
        self.model, self.rounds_wanted, self.chunk = model, set(rounds_wanted), chunk
        self.positions: dict[int, torch.Tensor] = {}  # layer -> (H_kv, n) positions (-1: padding)
        self.rounds: dict[int, int] = {}  # layer -> rounds seen (cut calls)
        self.layer = None
        self.rows: list[dict] = []
        self.handles = []
        self.budget = budget

    def hook(self, module, args, kwargs, output):
        from kvpress_prob.correction import bias as correction
        from kvpress_prob.decoding import rounds
        from kvpress_prob.proposals.attention import rope_queries

        layer = module.layer_idx
        hidden = kwargs["hidden_states"]
        cache = kwargs["past_key_values"]
        keys = cache.layers[layer].keys  # (1, H_kv, n, d): the entries this forward attended
        c, n = hidden.shape[1], keys.shape[2]
        start = int(kwargs["position_ids"][0, 0]) if kwargs.get("position_ids") is not None else 0
        new = torch.arange(start, start + c).expand(keys.shape[1], c)
        self.positions[layer] = new.clone() if layer not in self.positions or c > self.chunk else \
            torch.cat([self.positions[layer], new], -1)
        self.layer = layer
        if c > self.chunk or self.rounds.get(layer, 0) not in self.rounds_wanted or start - self.budget < 0:
            return
        r = self.rounds.get(layer, 0)
        if any(row["round"] == r and row["layer"] == layer for row in self.rows):
            return  # the first forward after round r only
        bias = rounds.extended_bias(correction.bias_of(module, cache), (1, keys.shape[1], n), keys.device)
        queries = rope_queries(module, hidden, kwargs["position_embeddings"]).float()
        mass = rounds.buffered_attention(queries, keys, bias, getattr(module, "scaling", keys.shape[-1] ** -0.5))
        mass = mass.view(1, keys.shape[1], -1, n).mean(2)[0] / c  # (H_kv, n): mean over queries and query heads
        pos = self.positions[layer]
        old = (pos >= N_SINK) & (pos < self.budget)
        real = rounds.is_real(bias)[0, :, : n - c]  # the entries held before this chunk
        w = bias[0, :, : n - c].double().exp() * real
        k = real.sum(-1).double()
        self.rows.append({
            "round": r, "layer": layer,
            "max_w": w.amax(-1).tolist(),
            "ess": ((w.sum(-1) ** 2) / (k * (w ** 2).sum(-1))).tolist(),
            "sum_w_over_seen": (w.sum(-1) / start).tolist(),
            "old_share": (mass * old).sum(-1).tolist(),
        })

    def cut_spy(self, original):
        def spy(keys, values, bias, keep, log_weight, correct):
            out = original(keys, values, bias, keep, log_weight, correct)
            order = out[3][0]  # (H_kv, S')
            pos = self.positions[self.layer].gather(-1, order)
            counts = keep[0].sum(-1)
            self.positions[self.layer] = pos.masked_fill(torch.arange(pos.shape[-1]) >= counts[:, None], -1)
            self.rounds[self.layer] = self.rounds.get(self.layer, 0) + 1
            return out
        return spy


def watch_stream(model, ids, press, schedule, rounds_wanted, state: dict | None = None) -> list[dict]:
    """Feed ``ids`` by ``schedule`` under ``press`` (None: full cache; then "rounds" count intervals).
    ``state``, if given, receives the final "positions" (layer -> (H_kv, n)) and "cache"."""
    from kvpress_prob.decoding import rounds
    from evaluation.tasks.streaming.drive import feed

    watch = Watch(model, rounds_wanted, schedule.chunk, schedule.budget)
    original = rounds.cut
    handles = [layer.self_attn.register_forward_hook(watch.hook, with_kwargs=True) for layer in model.model.layers]
    rounds.cut = watch.cut_spy(original)
    full_counter = None
    if press is None:  # the full cache: a "round" every interval tokens, for the same forwards
        def full_counter(module, args, kwargs, output):
            start = int(kwargs["position_ids"][0, 0])
            if kwargs["hidden_states"].shape[1] <= schedule.chunk and (start + schedule.chunk - schedule.budget) % schedule.interval == 0:
                watch.rounds[module.layer_idx] = watch.rounds.get(module.layer_idx, 0) + 1
        handles += [layer.self_attn.register_forward_hook(full_counter, with_kwargs=True) for layer in model.model.layers]
    try:
        fed = feed(model, ids, schedule, press)
        if state is not None:
            state.update(positions=watch.positions, cache=fed["cache"])
    finally:
        rounds.cut = original
        for h in handles:
            h.remove()
    return watch.rows


def summarise(rows: list[dict]) -> dict:
    """round -> median over layers and heads of every measure."""
    out = {}
    for r in sorted({row["round"] for row in rows}):
        mine = [row for row in rows if row["round"] == r]
        out[r] = {key: float(torch.tensor([v for row in mine for v in row[key]]).median())
                  for key in ("max_w", "ess", "sum_w_over_seen", "old_share")}
    return out


def main(argv=None) -> None:
    from evaluation.tasks.streaming.streams import streams
    from evaluation.tasks.streaming.drive import Schedule
    from evaluation.tasks.streaming.presses import stream_presses
    from evaluation.tasks.streaming.runner import head_dim
    from kvpress_prob.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="dev")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--interval", type=int, default=32)
    p.add_argument("--rounds", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--presses", nargs="+", default=["prob_decode_min_variance_priority",
                                                     "prob_decode_min_variance_priority_nocorr"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    n = args.budget + (max(args.rounds) + 1) * args.interval + args.chunk + 1
    selected = [s for s in streams(tokenizer, args.split, 4096)][: args.streams]
    schedule = Schedule(n=n, budget=args.budget, chunk=args.chunk, interval=args.interval)
    result = {"command": "python -m experiments.stream_weights " + " ".join(argv or []), "n": n, "presses": {}}
    full = {s.stream_id: summarise(watch_stream(model, s.ids[:, :n], None, schedule, args.rounds))
            for s in selected}
    for name in args.presses:
        per_stream = {}
        for s in selected:
            press = stream_presses()[name](schedule, args.seed, head_dim(model), model.dtype)
            per_stream[s.stream_id] = summarise(watch_stream(model, s.ids[:, :n], press, schedule, args.rounds))
        result["presses"][name] = per_stream
    result["full"] = full
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Compounded weights while decoding ({args.split} split, {len(selected)} streams of {n} tokens, budget "
             f"{args.budget}, chunk {args.chunk}, interval {args.interval}, seed {args.seed})", "",
             "Medians over layers and KV heads at the forward after round R, means over streams. "
             f"old share: attention paid to the prefill's entries (positions {N_SINK}..{args.budget - 1}), the oldest survivors; "
             "full: the full cache's share for the same positions at the same forward.", "",
             "| press | R | max w | ESS / k | sum w / seen | old share | full old share |", "|---|---|---|---|---|---|---|"]
    for name, per_stream in result["presses"].items():
        for r in args.rounds:
            vals = [per_stream[s][r] for s in per_stream if r in per_stream[s]]
            fulls = [full[s][r] for s in full if r in full[s]]
            if not vals:
                continue
            mean = lambda key, xs: sum(x[key] for x in xs) / len(xs)  # noqa: E731
            lines.append(f"| {name} | {r} | {mean('max_w', vals):.2f} | {mean('ess', vals):.3f} | "
                         f"{mean('sum_w_over_seen', vals):.3f} | {mean('old_share', vals):.4f} | "
                         f"{mean('old_share', fulls):.4f} |")
    (out / "weights.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
