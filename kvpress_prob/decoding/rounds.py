"""One decoding-time compression round of one layer, on explicit tensors (``SamplingDecodingPress``).

A layer's cache holds n entries per KV head: the S stored at the last compression (or by a prefill
press), whose correction bias (b, H_kv, S) lives on the cache (``kvpress_prob.correction.bias``), then
the n - S entries appended while decoding, whose bias is 0. A round

1. extends the bias to all n entries (``extended_bias``): padding left by a variable-count design
   carries the most negative finite value and is never kept;
2. fixes the entries kept exactly (``fixed_entries``): the first ``n_sink`` and the last ``window``
   real entries of each head, and optionally the entries whose values have the largest range
   (VaSE's protection);
3. draws ``target_size`` - (fixed) of the other real entries from a proposal with a sampling design
   (``draw``), each kept entry with its Horvitz-Thompson log-weight, log(1 / q) for an inclusion
   probability q (0 for the fixed ones);
4. cuts the cache to the kept entries in positional order (``cut``) and compounds the weights: a
   kept entry's new bias is its old bias plus its log-weight. An entry that survived rounds with
   inclusion probabilities q1, q2, ... (a prefill draw included) so carries log 1 / (q1 q2 ...).

Why the product is the right weight: round r keeps entry i with
probability q_r(i) given everything before it, so E[1{kept in rounds 1..R} / (q_1 ... q_R)] = 1 by
the tower rule, and sum_kept w_i e^{s_i} v_i stays unbiased for the full prefix sum.
"""

from __future__ import annotations

import torch

from kvpress_prob.correction import bias as correction
from kvpress_prob.samplers import Sampler
from kvpress_prob.samplers.base import ratio_keeping
from kvpress_prob.samplers.priority import PrioritySampler, priority_draw

LOWEST = torch.finfo(torch.float32).min  # bias of padding: exp(LOWEST - max) = 0


def extended_bias(stored: torch.Tensor | None, shape: tuple[int, int, int], device) -> torch.Tensor:
    """The bias (b, H_kv, n) float32 of all n entries: ``stored`` (b, H_kv, S) on the first S, 0 after.

    Padding is recognised in the stored bias's own dtype (``correction.is_padding``: its lowest finite
    value, -65504 in float16) and becomes LOWEST here; a plain cast would leave float16 padding at
    -65504, which ``is_real`` would read as an entry."""
    b, h, n = shape
    bias = torch.zeros(b, h, n, dtype=torch.float32, device=device)
    if stored is not None:
        s = stored.shape[-1]
        if s > n:
            raise RuntimeError(f"the stored bias covers {s} entries but the layer holds only {n}")
        stored = stored.to(device=device)
        bias[..., :s] = torch.where(correction.is_padding(stored), LOWEST,
                                    stored.to(torch.float32).clamp_min(LOWEST))
    return bias


def is_real(bias: torch.Tensor) -> torch.Tensor:
    """Entries that are not padding: (b, H_kv, n) bool."""
    return bias > LOWEST / 2


def fixed_entries(real: torch.Tensor, n_sink: int, window: int, values: torch.Tensor | None = None,
                  protect_values: int = 0) -> torch.Tensor:
    """Entries kept exactly, (b, H_kv, n) bool: per head the first ``n_sink`` and the last ``window``
    real entries and, with ``protect_values`` > 0, that many of the others whose value vectors
    (b, H_kv, n, d) have the largest range max_d v - min_d v (VaSE, Chang et al. 2026)."""
    rank = real.long().cumsum(-1)  # 1-based rank among real entries
    total = rank[..., -1:]
    fixed = real & ((rank <= n_sink) | (rank > total - window))
    if protect_values > 0:
        spread = (values.amax(-1) - values.amin(-1)).float()  # (b, H_kv, n)
        spread = spread.masked_fill(~real | fixed, float("-inf"))
        top = spread.topk(min(protect_values, spread.shape[-1]), dim=-1).indices
        fixed = fixed | (torch.zeros_like(fixed).scatter_(-1, top, True) & real)
    return fixed


def proposal_over(weights: torch.Tensor, candidates: torch.Tensor, floor: float) -> torch.Tensor:
    """pi (b, H_kv, n) float64 on the candidates, 0 elsewhere: weights (>= 0) restricted to them,
    normalised, mixed with ``floor`` of uniform mass (every candidate can be drawn)."""
    w = weights.double().clamp_min(0) * candidates
    m = candidates.sum(-1, keepdim=True).clamp_min(1)
    total = w.sum(-1, keepdim=True)
    p = torch.where(total > 0, w / total.clamp_min(1e-300), candidates / m)
    return ((1.0 - floor) * p + floor / m) * candidates


def draw(pi: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor, sampler: Sampler,
         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep k (b, H_kv) of each head's candidates (b, H_kv, n) by ``sampler`` from pi (b, H_kv, n):
    (keep (b, H_kv, n) bool, log_weight (b, H_kv, n) float64: log 1/q where kept, -inf elsewhere).

    Heads with the same candidate count m are drawn in one call of the sampler (scope "head",
    ``ratio_keeping(k, m)``); a head with k = m keeps all its candidates with weight 1. Raises ValueError for
    k outside [0, m] (a budget larger than the context)."""
    b, h, n = pi.shape
    m = candidates.sum(-1)  # (b, H_kv)
    if (k < 0).any() or (k > m).any():
        worst = int((k - m).argmax()) if (k > m).any() else int(k.argmin())
        raise ValueError(
            f"k (entries drawn per head) must be in [0, the head's candidates m]: got k={k.reshape(-1)[worst].item()} "
            f"for m={m.reshape(-1)[worst].item()} (a budget larger than the context)"
        )
    keep = candidates & (k == m)[..., None]
    log_weight = torch.where(keep, 0.0, float("-inf")).double()
    rows_pi, rows_cand = pi.reshape(b * h, n), candidates.reshape(b * h, n)
    flat_keep, flat_lw = keep.reshape(b * h, n), log_weight.reshape(b * h, n)
    flat_m, flat_k = m.reshape(-1), k.reshape(-1)
    todo = flat_k < flat_m
    for (count, kept) in sorted({(int(c), int(q)) for c, q in zip(flat_m[todo].tolist(), flat_k[todo].tolist())}):
        rows = (todo & (flat_m == count) & (flat_k == kept)).nonzero().squeeze(-1)
        order = (~rows_cand[rows]).to(torch.int8).argsort(dim=-1, stable=True)[:, :count]  # candidates, in order
        p = rows_pi[rows].gather(-1, order)
        p = p / p.sum(-1, keepdim=True)
        if kept == 0:
            continue
        if type(sampler) is PrioritySampler and sampler.min_keep == 0:  # its draw without solving for k: same result
            keep_rows, lw_rows = priority_draw(p, torch.full((len(rows),), kept, device=p.device), generator)
        else:
            result = sampler(p[None, None], ratio_keeping(kept, count), "head", generator)  # (1, 1, rows, count)
            keep_rows, lw_rows = result.keep[0, 0], result.log_weight[0, 0]
        flat_keep[rows] = flat_keep[rows].scatter(-1, order, keep_rows)
        flat_lw[rows] = flat_lw[rows].scatter(-1, order, lw_rows.float().double())
    return flat_keep.view(b, h, n), flat_lw.view(b, h, n)


def cut(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor,
        log_weight: torch.Tensor, correct: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut keys, values (b, H_kv, n, d) to the kept entries (b, H_kv, n), in positional order,
    padded to the largest head's count S'. Returns (keys, values, bias (b, H_kv, S') float32, order
    (b, H_kv, S') the gathered indices). The new bias is the old one plus, if ``correct``, the
    log-weight (compounding); LOWEST on padding."""
    counts = keep.sum(-1)  # (b, H_kv)
    stored = max(1, int(counts.max()))
    order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :stored]  # kept first, in position order
    index = order[..., None].expand(-1, -1, -1, keys.shape[-1])
    new = bias + log_weight.float() if correct else bias
    new = new.gather(-1, order)
    padding = torch.arange(stored, device=keys.device) >= counts[..., None]
    new = new.masked_fill(padding, LOWEST)
    return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous(), new, order


def controlled(log_weight: torch.Tensor, bias: torch.Tensor, drawn: torch.Tensor, candidates: torch.Tensor,
               temperature: float = 1.0, max_log_weight: float = float("inf"), renormalise: bool = False) -> torch.Tensor:
    """The increment of the bias of each drawn entry (b, H_kv, n) float64, from the draw's log-weights
    log 1/q (b, H_kv, n) and the bias (b, H_kv, n) the entries carry before the round; 0 elsewhere
    (sinks, window and entries not drawn). In this order:

    - ``temperature``: log(1/q) / T;
    - ``renormalise``: the drawn entries' compounded weights are scaled, per head, to sum to the
      candidates' weights before the round (sum over drawn of e^(b + inc) = sum over candidates of
      e^b): a ratio estimator, exact on the total that Horvitz-Thompson only matches in expectation;
    - ``max_log_weight``: a drawn entry's compounded bias b + inc is capped there (truncated
      importance weights, Ionides 2008)."""
    inc = torch.where(drawn, log_weight.double() / temperature, 0.0)
    old = bias.double()
    if renormalise:
        minus = torch.tensor(float("-inf"), dtype=torch.float64, device=old.device)
        before = torch.where(candidates, old, minus).logsumexp(-1, keepdim=True)
        after = torch.where(drawn, old + inc, minus).logsumexp(-1, keepdim=True)
        shift = torch.where(torch.isfinite(after), before - after, 0.0)
        inc = torch.where(drawn, inc + shift, 0.0)
    if max_log_weight != float("inf"):
        inc = torch.where(drawn, torch.minimum(old + inc, torch.full_like(old, max_log_weight)) - old, 0.0)
    return inc


def harmonic_rows(n_q: int, device=None) -> torch.Tensor:
    """The harmonic prior over B buffered query rows, h_j proportional to 1 / (B - j) (the most
    recent query weighs most; pi_min-h's prior over the buffer), summing to B so that
    uniform rows (all 1) and harmonic rows give attention mass on the same scale. (B,) float32."""
    h = 1.0 / torch.arange(n_q, 0, -1, device=device, dtype=torch.float32)
    return h * (n_q / h.sum())


def buffered_attention(queries: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scaling: float,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the B buffered queries (b, H_q, B, d), with RoPE, over the n cache entries
    (b, H_kv, n, d) with the correction bias (b, H_kv, n): the B queries are the last B entries, and
    query j sees entries 0..n-B+j. Returns the attention summed over the queries, each weighted by
    ``rows`` (B,) if given (``harmonic_rows``), (b, H_q, n) float32."""
    b, hq, n_q, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = queries.float().reshape(b, hkv, g * n_q, d)
    logits = torch.matmul(q, keys.float().transpose(2, 3)).mul_(scaling).view(b, hkv, g, n_q, n)
    logits = logits + bias[:, :, None, None, :]
    j = torch.arange(n_q, device=keys.device)[:, None]
    i = torch.arange(n, device=keys.device)[None, :]
    logits = logits.masked_fill(i > n - n_q + j, float("-inf"))
    attention = torch.softmax(logits, dim=-1)
    if rows is not None:
        attention = attention * rows.to(attention.device)[:, None]
    return attention.sum(3).reshape(b, hq, n)
