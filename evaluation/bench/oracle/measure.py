"""The oracle bench's instances, brute-force optima and draws."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pandas as pd
import torch


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
    from kvpress_prob.samplers.budget import solve_draws
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
