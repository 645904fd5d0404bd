"""KVzip's global kept set evicted for real (``topk_kvzip_global``): the global top L H compute_n_kept(n, r) of
KVzip's scores in RaggedLayers, at exactly snapkv's bytes; kvpress's own set up to L H entries; built alike by a
prefill under the press and by the harness's shared prefill; decoded alike by its own route and by batched decoding."""

import pytest
import torch
from kvpress.utils import compute_n_kept

from evaluation.engine import Compressed, Prefill, cache_summary, generate_batch, press_prefill
from evaluation.engine.prefill import bias_bytes
from kvpress_prob.cache import RaggedLayer
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.allocations import global_keep, kvzip_keep
from kvpress_prob.presses.sampling import language_model
from tests.conftest import TIE, greedy_margins, random_ids, tiny_model

N = 96


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_global_set_at_snapkv_bytes_and_kvpress_set_up_to_rounding(ratio):
    model = tiny_model("qwen3", layers=4)
    ids = random_ids(N, seed=21)
    kvzip_scoring.clear_scores()
    press = get_press("topk_kvzip_global", ratio)
    cache = press_prefill(model, ids, press)
    L, H = 4, model.config.num_key_value_heads
    assert all(isinstance(layer, RaggedLayer) for layer in cache.layers)
    kept = sum(sum(layer.lengths) for layer in cache.layers)
    assert kept == L * H * compute_n_kept(N, ratio)
    snapkv = press_prefill(model, ids, get_press("snapkv", ratio))
    assert cache_summary(cache, press, N)[1] == cache_summary(snapkv, None, N)[1]  # K and V: snapkv's bytes exactly
    assert bias_bytes(cache, language_model(model).layers) == 0
    scores = kvzip_scoring.SCORES.stored()[0].float().clone()  # KVzip's scores of this context, sinks raised
    scores[..., : press.n_sink] = scores.amax() + 1
    keep = global_keep(scores, ratio)
    assert [layer.lengths for layer in cache.layers] == [tuple(c) for c in keep[:, 0].sum(-1).tolist()]
    assert int((keep ^ kvzip_keep(scores, ratio)).sum()) <= L * H  # kvpress's own set, up to rounding
    counts = keep.sum(-1)
    assert counts.min() < counts.max()  # heads keep their own counts


def test_shared_prefill_builds_the_same_cache_and_batched_decoding_answers_as_its_route(tokenizer):
    model = tiny_model("llama")
    ids, question = random_ids(N, seed=23), random_ids(6, seed=24)
    kvzip_scoring.clear_scores()
    own = press_prefill(model, ids, get_press("topk_kvzip_global", 0.75))
    shared = Prefill(model, ids, [get_press("topk_kvzip_global", 0.75)]).compress(get_press("topk_kvzip_global", 0.75))
    for a, b in zip(own.layers, shared.layers):
        assert a.lengths == b.lengths and torch.equal(a.flat_keys, b.flat_keys)
    layers = language_model(model).layers
    with greedy_margins(model) as margins, torch.no_grad():
        batched = generate_batch(model, tokenizer, question, [Compressed.take(shared, layers)], N, 6)[0]
        tokens, fed, position = [], question, N
        for _ in range(6):  # kvpress's generate_answer on the ragged cache itself
            logits = model(input_ids=fed, past_key_values=own,
                           position_ids=torch.arange(position, position + fed.shape[1])[None]).logits
            position += fed.shape[1]
            tokens.append(int(logits[0, -1].argmax()))
            fed = torch.tensor([[tokens[-1]]])
    assert min(margins) > TIE
    assert batched == tokenizer.decode(tokens, skip_special_tokens=True)
