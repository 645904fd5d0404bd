"""The corrected attention through the patched path against a slow dense reference."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from kvpress_prob import get_press
from kvpress_prob.correction import bias as correction

N_PREFIX = 96


def rotate(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def project(module, hidden, position_embeddings):
    """Queries, keys, values of new tokens, written out: (H, q, d) each, float32."""
    q_len = hidden.shape[1]
    d = module.head_dim
    q = module.q_proj(hidden).view(q_len, -1, d).transpose(0, 1)
    k = module.k_proj(hidden).view(q_len, -1, d).transpose(0, 1)
    v = module.v_proj(hidden).view(q_len, -1, d).transpose(0, 1)
    if hasattr(module, "q_norm"):
        q, k = module.q_norm(q), module.k_norm(k)
    cos, sin = (t[0] for t in position_embeddings)  # (q, d)
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    return q.float(), k.float(), v.float()


def reference_attention(
    module, hidden, position_embeddings, prefix_keys, prefix_values, keep, log_weight, tau, q_len=None
):
    """Explicit loops and an explicit softmax: sum_i w_i e^{s_i} v_i + sum_new e^{s_j} v_j, normalised.

    hidden (1, t, D): every token since the prefill, the last q_len of them this step's queries;
    prefix_keys / values (H_kv, n, d) before eviction, keep (H_kv, n), log_weight (H_kv, n).
    """
    q_len = q_len or hidden.shape[1]
    q, k_new, v_new = project(module, hidden, position_embeddings)
    q = q[:, -q_len:]  # queries of this step; keys and values of every new token so far
    hq, _, d = q.shape
    g = hq // prefix_keys.shape[0]
    out = torch.zeros(q_len, hq, d, device=q.device)
    for head in range(hq):
        kv = head // g
        kept = keep[kv].nonzero().flatten()
        for i in range(q_len):
            visible = k_new.shape[1] - q_len + i + 1  # causal among new tokens
            logits = [q[head, i] @ prefix_keys[kv, j].float() / math.sqrt(d) + log_weight[kv, j] / tau for j in kept]
            logits += [q[head, i] @ k_new[kv, t] / math.sqrt(d) for t in range(visible)]
            logits = torch.stack(logits)
            e = torch.exp(logits - logits.max())
            p = e / e.sum()
            vals = torch.cat([prefix_values[kv, kept].float(), v_new[kv, :visible]])
            out[i, head] = (p[:, None] * vals).sum(0)
    return module.o_proj(out.reshape(1, q_len, hq * d).to(hidden.dtype)).float()


def run(model, press, ids, new_ids):
    """Prefill with the press, capturing full prefix keys; then forward new_ids (q_len > 1) and one
    more token (q_len = 1), capturing each attention module's inputs and output."""
    layers = model.model.layers
    full, seen = {}, []

    def grab_prefill(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        full[module.layer_idx] = (layer.keys[0].clone(), layer.values[0].clone())

    def grab(module, args, kwargs, output):
        seen.append((module, kwargs["hidden_states"], kwargs["position_embeddings"], output[0]))

    hooks = [layer.self_attn.register_forward_hook(grab_prefill, with_kwargs=True) for layer in layers]
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    for h in hooks:
        h.remove()
    hooks = [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in layers]
    n = ids.shape[1]
    positions = torch.arange(n, n + new_ids.shape[1], device=ids.device)[None]
    with torch.no_grad():
        model(input_ids=new_ids, past_key_values=cache, position_ids=positions)
        model(input_ids=new_ids[:, -1:], past_key_values=cache, position_ids=positions[:, -1:] + 1)
    for h in hooks:
        h.remove()
    return full, seen, cache


def check_steps(press, full, seen, tau, **tolerance):
    """Compare every captured step with the reference; earlier new tokens enter as keys."""
    history = {}
    for module, hidden, pos, output in seen:
        idx = module.layer_idx
        prev_h, prev_pos = history.get(idx, (hidden[:, :0], tuple(t[:, :0] for t in pos)))
        all_h = torch.cat([prev_h, hidden], dim=1)
        all_pos = tuple(torch.cat([a, b], dim=1) for a, b in zip(prev_pos, pos))
        history[idx] = (all_h, all_pos)
        keep, log_w = press.last_draw.keep[idx, 0], press.last_draw.log_weight[idx, 0]
        ref = reference_attention(module, all_h, all_pos, *full[idx], keep, log_w, tau, q_len=hidden.shape[1])
        torch.testing.assert_close(output.float(), ref, **tolerance)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name,tau", [("prob_min_h", 1.0), ("prob_snapkv", 2.0), ("prob_knorm_nocorr", math.inf)])
def test_corrected_attention_matches_dense_reference(arch, name, tau):
    model = tiny_model(arch)
    press = get_press(name, 0.5, temperature=tau if math.isfinite(tau) else 1.0)
    full, seen, cache = run(model, press, random_ids(N_PREFIX), random_ids(5, seed=1))
    kept = torch.tensor(press.stats["kept"])  # (L, H_kv)
    assert len(set(kept.flatten().tolist())) > 1, "heads should keep different counts"
    assert len(set(press.stats["stored"])) > 1, "layers should store different lengths"
    assert len(seen) == 2 * len(model.model.layers)
    check_steps(press, full, seen, tau, atol=2e-5, rtol=1e-4)


def test_bfloat16_loose():
    model = tiny_model("llama", dtype=torch.bfloat16)
    press = get_press("prob_min_h", 0.5)
    full, seen, _ = run(model, press, random_ids(N_PREFIX), random_ids(4, seed=2))
    check_steps(press, full, seen, 1.0, atol=3e-2, rtol=3e-2)


def test_reference_detects_a_wrong_weight():
    """The comparison above can fail: perturbing one log-weight moves the output."""
    model = tiny_model("llama")
    press = get_press("prob_min_h", 0.5)
    full, seen, _ = run(model, press, random_ids(N_PREFIX), random_ids(3, seed=3))
    module, hidden, pos, output = seen[0]
    keep, log_w = press.last_draw.keep[0, 0], press.last_draw.log_weight[0, 0].clone()
    j = keep[0].nonzero()[0, 0]
    log_w[0, j] += 3.0
    ref = reference_attention(module, hidden, pos, *full[0], keep, log_w, 1.0)
    assert not torch.allclose(output.float(), ref, atol=2e-5, rtol=1e-4)


def test_zero_ratio_is_exactly_no_press(model):
    ids, new = random_ids(80), random_ids(4, seed=5)
    logits = []
    for press in (None, get_press("prob_min_h", 0.0)):
        cache = DynamicCache()
        with torch.no_grad():
            if press is None:
                model.model(input_ids=ids, past_key_values=cache)
            else:
                with press(model):
                    model.model(input_ids=ids, past_key_values=cache)
            out = model(input_ids=new, past_key_values=cache, position_ids=torch.arange(80, 84)[None])
        logits.append(out.logits)
    assert torch.equal(logits[0], logits[1])


def test_prefill_clears_the_correction(model):
    """A later prefill without a press runs as if no press had ever been used."""
    ids = random_ids(64)
    with torch.no_grad():
        cache = DynamicCache()
        with get_press("prob_min", 0.5)(model):
            model.model(input_ids=ids, past_key_values=cache)
        assert correction.bias_of(model.model.layers[0].self_attn) is not None
        fresh = model(input_ids=ids).logits
        assert correction.bias_of(model.model.layers[0].self_attn) is None
        plain = tiny_model(model.config.model_type)(input_ids=ids).logits
    torch.testing.assert_close(fresh, plain)


def test_batch_mismatch_is_refused():
    """A cache compressed for batch 1 read by a batch of 2 fails loudly instead of broadcasting."""
    model = tiny_model("llama")
    cache = DynamicCache()
    with torch.no_grad(), get_press("prob_min", 0.5)(model):
        model.model(input_ids=random_ids(64), past_key_values=cache)
    cache.batch_repeat_interleave(2)  # the keys now have batch 2, the correction batch 1
    with pytest.raises(ValueError, match="batch size 2"), torch.no_grad():
        model(input_ids=random_ids(1).repeat(2, 1), past_key_values=cache, position_ids=torch.tensor([[64], [64]]))
