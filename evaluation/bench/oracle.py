"""Exact eviction on small synthetic instances, against top-k and sampling with and without SNIS.

One instance: n keys and values in R^d (standard normal), an eviction query q_t = s * z (z standard
normal, s = ``query_scale``), and ``later`` queries q_j = q_t + noise * s * z_j drawn near it.
Attention at q: p(q)_i = softmax(q . k_i / sqrt(d)); the output over a kept set S with weights w
(w = 1: plain renormalisation) is o_S(q) = sum_{i in S} w_i e^{s_i} v_i / sum_{i in S} w_i e^{s_i};
the error is the Euclidean distance ||o_S(q) - o(q)|| to the full output.

Methods (k = n / 2 kept):
- opt_now: the subset of size k with the least error at q_t (brute force over all C(n, k));
- opt_later: the subset of size k with the least mean error over the later queries (brute force);
- topk: the k largest p_t = p(q_t);
- sample: Poisson counts c_i ~ Poisson(m p_t,i) with m from ``kvpress_prob.budget.solve_draws`` so
  that the expected kept count is k (``kvpress_prob.sampling.sample``), kept = c > 0, plain
  renormalisation; sample+SNIS: the same draws with weights c_i / (m p_t,i) (the paper's SNIS);
  sample+SNIS-HT (beyond the paper, ``inclusion_weights=True``): the same kept sets with weights
  1 / q_i, q_i = 1 - exp(-m p_t,i). Sampling errors are averaged over ``draws`` draws per instance
  (its kept count is k only in expectation).

Relative error = mean error of the method / mean error of the optimum for the same criterion
(opt_now at q_t, opt_later at the later queries), over the instances of one n; the per-instance
median of the ratio is reported too.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evaluation.bench import common

METHODS = ["opt_now", "opt_later", "topk", "sample", "sample+SNIS", "sample+SNIS-HT"]


def make_instance(n: int, d: int, later: int, query_scale: float, noise: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d))
    values = rng.standard_normal((n, d))
    q_t = query_scale * rng.standard_normal(d)
    q_later = q_t[None] + noise * query_scale * rng.standard_normal((later, d))
    return {"keys": keys, "values": values, "queries": np.vstack([q_t[None], q_later])}  # row 0 = q_t


def scores(instance: dict) -> np.ndarray:
    """(Q, n) logits q . k / sqrt(d) for every query (row 0 = the eviction query)."""
    d = instance["keys"].shape[1]
    return instance["queries"] @ instance["keys"].T / math.sqrt(d)


def outputs(logits: np.ndarray, values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Attention outputs for many weightings at once.

    logits (Q, n); values (n, d); weights (B, n), non-negative (0 = evicted).
    Returns (B, Q, d); a weighting with nothing kept gives the zero vector.
    """
    e = np.exp(logits - logits.max(axis=1, keepdims=True))  # (Q, n)
    num = np.einsum("bn,qn,nd->bqd", weights, e, values)
    den = weights @ e.T  # (B, Q)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = num / den[..., None]
    return np.where(den[..., None] > 0, out, 0.0)


def full_output(logits: np.ndarray, values: np.ndarray) -> np.ndarray:
    return outputs(logits, values, np.ones((1, values.shape[0])))[0]  # (Q, d)


def errors(logits: np.ndarray, values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(B, Q) error ||o_w(q) - o(q)|| of each weighting at each query."""
    return np.linalg.norm(outputs(logits, values, weights) - full_output(logits, values)[None], axis=-1)


def brute_force(logits: np.ndarray, values: np.ndarray, k: int, chunk: int = 20000) -> dict:
    """Exhaustive search over all subsets of size k: the best at q_t (row 0) and the best on average
    over the later queries (rows 1:). Returns the subsets (sorted index tuples) and their errors."""
    n = values.shape[0]
    best_now, best_later = (math.inf, None), (math.inf, None)
    combos = itertools.combinations(range(n), k)
    while True:
        block = np.array(list(itertools.islice(combos, chunk)))
        if block.size == 0:
            break
        masks = np.zeros((len(block), n))
        np.put_along_axis(masks, block, 1.0, axis=1)
        err = errors(logits, values, masks)  # (B, Q)
        now, later = err[:, 0], err[:, 1:].mean(axis=1) if err.shape[1] > 1 else err[:, 0]
        i, j = int(now.argmin()), int(later.argmin())
        if now[i] < best_now[0]:
            best_now = (float(now[i]), tuple(block[i]))
        if later[j] < best_later[0]:
            best_later = (float(later[j]), tuple(block[j]))
    return {"now": best_now[1], "later": best_later[1]}


def mask_of(subset, n: int) -> np.ndarray:
    mask = np.zeros((1, n))
    mask[0, list(subset)] = 1.0
    return mask


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def sample_weights(p_t: np.ndarray, k: int, draws: int, seed: int, inclusion_weights: bool = False):
    """``draws`` Poisson draws from pi = p_t with expected kept count k, through kvpress_prob.

    Returns (kept (draws, n) 0/1, SNIS weights (draws, n): c_i / (m pi_i) on kept, 0 elsewhere;
    1 / q_i instead with ``inclusion_weights``). The same seed gives the same kept sets either way."""
    from kvpress_prob.budget import solve_draws
    from kvpress_prob.samplers.poisson import poisson_sample

    pi = torch.as_tensor(p_t, dtype=torch.float64)[None, None, None, :]  # (L=1, b=1, H=1, n)
    m = solve_draws(pi, torch.tensor(float(k)), "head")  # (1, 1, 1, 1)
    pis = pi.expand(1, 1, draws, -1).contiguous()  # the draws as heads: independent, same pi
    generator = torch.Generator().manual_seed(seed)
    kept, log_w = poisson_sample(pis, m.expand(1, 1, draws, 1), generator, inclusion_weights=inclusion_weights)
    kept = kept[0, 0].double()
    w = torch.where(kept.bool(), log_w[0, 0].exp(), torch.zeros_like(kept))
    return kept.numpy(), w.numpy()


def solve_instance(instance: dict, k: int, draws: int, seed: int) -> dict:
    logits, values = scores(instance), instance["values"]
    n = values.shape[0]
    p_t = np.exp(logits[0] - logits[0].max())
    p_t /= p_t.sum()
    best = brute_force(logits, values, k)
    topk = tuple(sorted(np.argsort(-p_t, kind="stable")[:k].tolist()))
    kept, w = sample_weights(p_t, k, draws, seed)
    kept_ht, w_ht = sample_weights(p_t, k, draws, seed, inclusion_weights=True)
    assert np.array_equal(kept, kept_ht)
    res = {}
    for name, weights in (("opt_now", mask_of(best["now"], n)), ("opt_later", mask_of(best["later"], n)),
                          ("topk", mask_of(topk, n)), ("sample", kept), ("sample+SNIS", w), ("sample+SNIS-HT", w_ht)):
        err = errors(logits, values, weights)  # (B, Q)
        res[name] = {"now": float(err[:, 0].mean()), "later": float(err[:, 1:].mean())}
    res["jaccard_now_later"] = jaccard(best["now"], best["later"])
    res["jaccard_topk_now"] = jaccard(topk, best["now"])
    res["jaccard_topk_later"] = jaccard(topk, best["later"])
    res["topk_is_opt_now"] = topk == best["now"]
    res["kept_mean"] = float(kept.sum(1).mean())
    res["kept_std"] = float(kept.sum(1).std())
    res["full_norm_now"] = float(np.linalg.norm(full_output(logits, values)[0]))
    return res


def run(ns, d, instances, later, draws, query_scale, noise, seed, log=print) -> pd.DataFrame:
    rows = []
    for n in ns:
        t0 = time.time()
        k = n // 2
        for i in range(instances):
            inst_seed = seed * 1_000_003 + 1000 * n + i
            res = solve_instance(make_instance(n, d, later, query_scale, noise, inst_seed), k, draws, inst_seed)
            for method in METHODS:
                rows.append({"n": n, "k": k, "instance": i, "method": method,
                             "err_now": res[method]["now"], "err_later": res[method]["later"],
                             **{key: res[key] for key in ("jaccard_now_later", "jaccard_topk_now", "jaccard_topk_later",
                                                          "topk_is_opt_now", "kept_mean", "kept_std", "full_norm_now")}})
        log(f"[oracle] n={n}: {instances} instances in {time.time() - t0:.1f}s")
    return pd.DataFrame(rows)


def summarise(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    opt = rows[rows.method == "opt_now"].set_index(["n", "instance"]).err_now
    opt_l = rows[rows.method == "opt_later"].set_index(["n", "instance"]).err_later
    r = rows.set_index(["n", "instance"]).copy()
    r["ratio_now"] = r.err_now / opt.reindex(r.index).values
    r["ratio_later"] = r.err_later / opt_l.reindex(r.index).values
    g = r.reset_index().groupby(["n", "method"], sort=False)
    mean = g[["err_now", "err_later"]].mean()
    table = pd.DataFrame({
        "err now": mean.err_now,
        "rel now": mean.err_now / mean.err_now.xs("opt_now", level="method").reindex(mean.index.get_level_values("n")).values,
        "median ratio now": g.ratio_now.median(),
        "err later": mean.err_later,
        "rel later": mean.err_later / mean.err_later.xs("opt_later", level="method").reindex(mean.index.get_level_values("n")).values,
        "median ratio later": g.ratio_later.median(),
    })
    first = rows[rows.method == "topk"].groupby("n")
    overlap = pd.DataFrame({
        "Jaccard(opt_now, opt_later)": first.jaccard_now_later.mean(),
        "opt_now == opt_later": first.jaccard_now_later.apply(lambda j: (j == 1).mean()),
        "Jaccard(topk, opt_now)": first.jaccard_topk_now.mean(),
        "Jaccard(topk, opt_later)": first.jaccard_topk_later.mean(),
        "topk == opt_now": first.topk_is_opt_now.mean(),
        "sampled kept: mean": first.kept_mean.mean(),
        "sampled kept: std": first.kept_std.mean(),
        "|o(q_t)| mean": first.full_norm_now.mean(),
    })
    return table, overlap


def plot(table: pd.DataFrame, overlap: pd.DataFrame, out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    t = table.reset_index()
    for method, grp in t.groupby("method", sort=False):
        ax1.plot(grp.n, grp["rel now"], marker="o", label=method)
        ax2.plot(grp.n, grp["rel later"], marker="o", label=method)
    ax1.set(xlabel="n (k = n/2)", ylabel="mean error / optimum's", title="At the eviction query q_t", yscale="log")
    ax2.set(xlabel="n (k = n/2)", ylabel="mean error / optimum's", title="Mean over later queries", yscale="log")
    ax1.legend(fontsize=7)
    for col in ["Jaccard(opt_now, opt_later)", "Jaccard(topk, opt_now)", "Jaccard(topk, opt_later)"]:
        ax3.plot(overlap.index, overlap[col], marker="o", label=col)
    ax3.set(xlabel="n", ylabel="Jaccard", title="Overlap of subsets", ylim=(0, 1.05))
    ax3.legend(fontsize=7)
    fig.tight_layout()
    return common.save_figure(fig, out / "oracle.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ns", type=int, nargs="+", default=None, help="instance sizes n (default 8 12 16 20; --quick: 8 12 16)")
    parser.add_argument("--d", type=int, default=4, help="key / value / query dimension (default 4)")
    parser.add_argument("--instances", type=int, default=20, help="random instances per n (default 20)")
    parser.add_argument("--later", type=int, default=8, help="later queries per instance (default 8)")
    parser.add_argument("--draws", type=int, default=200, help="sampling draws per instance (default 200)")
    parser.add_argument("--query-scale", type=float, default=2.0, help="scale s of the queries, sharper attention when larger (default 2.0)")
    parser.add_argument("--noise", type=float, default=0.5, help="later queries: q_t + noise * s * N(0, I) (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the instances (default 0)")


def main(args: argparse.Namespace) -> dict:
    start = time.time()
    ns = args.ns or ([8, 12, 16] if args.quick else [8, 12, 16, 20])
    out = Path(args.out) / "oracle"
    info = common.machine_info()
    rows = run(ns, args.d, args.instances, args.later, args.draws, args.query_scale, args.noise, args.seed)
    table, overlap = summarise(rows)
    info["loadavg_end"] = common.loadavg()
    info["elapsed_s"] = time.time() - start
    settings = {"ns": ns, "d": args.d, "instances": args.instances, "later": args.later, "draws": args.draws,
                "query_scale": args.query_scale, "noise": args.noise, "seed": args.seed, "quick": args.quick}
    shown = table.reset_index().set_index("method")
    shown["n"] = shown.n.astype(str)
    common.write_json(out / "oracle.json", {"settings": settings, "machine": info, "summary": table.reset_index(),
                                            "overlap": overlap.reset_index(), "instances": rows})
    md = "\n".join([
        "# Oracle benchmark: exact eviction on small instances\n",
        f"Settings: {settings}. k = n/2 kept. Errors are ||o_S(q) - o(q)||_2 (see the module docstring); "
        "'rel' = mean error / mean error of the optimum for that criterion (opt_now at q_t, opt_later over the later "
        "queries); 'median ratio' = per-instance median of the same ratio. Sampling keeps k entries only in "
        "expectation (see 'sampled kept' below), so it can beat the size-k optimum. Note: with pi = p_t, the SNIS "
        "estimate at q_t is sum_i c_i v_i / sum_i c_i, a plain Monte-Carlo average of the values over the m draws "
        "(noisy: m is only about 3k here), while plain renormalisation keeps the exact p_t of "
        "every kept entry and only loses the evicted mass.\n",
        common.markdown_table(shown, float_format="{:.3f}"),
        "\n## Overlap of the optimal subsets\n",
        common.markdown_table(overlap, float_format="{:.3f}"),
        f"\nPlot: `oracle.png`. Elapsed: {info['elapsed_s']:.0f} s.\n",
    ])
    common.write_markdown(out / "oracle.md", md)
    plot(table, overlap, out)
    print(common.markdown_table(shown, float_format="{:.3f}"))
    print(common.markdown_table(overlap, float_format="{:.3f}"))
    print(f"[oracle] wrote {out}/oracle.json, oracle.md, oracle.png in {info['elapsed_s']:.0f} s")
    return {"summary": table, "overlap": overlap}
