"""The ragged cache (kvpress_prob/cache/ragged.py) in a model: its logits against a float64 dense reference with
explicit per-head masks and against kvpress's own masked ``KVzipPress`` on the same kept entries; kvpress's pipeline
and ``model.generate`` answer from it at the context's real positions; it holds exactly the kept entries' bytes,
copies deeply, and refuses what it cannot do."""

import copy

import pytest
import torch
from kvpress import KVPressTextGenerationPipeline, KVzipPress
from kvpress.presses.base_press import BasePress
from transformers import DynamicCache

from kvpress_prob.cache import RaggedLayer, evict_ragged
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.testing.reference import dense_reference, float64_copy, masked_keep
from tests.conftest import TIE, greedy_margins, random_ids, tiny_model

N = 48


def _keep(model, n: int, seed: int = 5) -> torch.Tensor:
    """(L, 1, H, n): a different random share kept per head (10 % to 90 %), the first entry always."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    share = torch.linspace(0.1, 0.9, cfg.num_hidden_layers * cfg.num_key_value_heads)
    keep = torch.rand(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, n, generator=g) < share.view(
        cfg.num_hidden_layers, 1, -1, 1)
    keep[..., 0] = True
    return keep


@torch.no_grad()
def _ragged_cache(model, ids, keep) -> DynamicCache:
    cache = DynamicCache()
    model.model(input_ids=ids, past_key_values=cache)
    for layer_idx in range(len(cache.layers)):
        evict_ragged(cache, layer_idx, keep[layer_idx])
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_float64_reference_for_a_question_and_a_decoding_step(arch):
    model = tiny_model(arch)
    model64 = float64_copy(model)
    ids, fed = random_ids(N, seed=1), random_ids(6, seed=2)
    keep = _keep(model, N)
    reference = dense_reference(model64, ids, fed, keep)
    scale = reference.abs().max()
    assert (dense_reference(model64, ids, fed, None) - reference).abs().max() > 1e-2 * scale  # eviction matters
    with torch.no_grad():
        question = model(input_ids=fed, past_key_values=_ragged_cache(model, ids, keep),
                         position_ids=torch.arange(N, N + 6)[None]).logits[0]
        cache = _ragged_cache(model, ids, keep)
        model(input_ids=fed[:, :-1], past_key_values=cache, position_ids=torch.arange(N, N + 5)[None])
        step = model(input_ids=fed[:, -1:], past_key_values=cache, position_ids=torch.tensor([[N + 5]])).logits[0, -1]
    assert (question.double() - reference).abs().max() <= 1e-4 * scale  # several new tokens
    assert (step.double() - reference[-1]).abs().max() <= 1e-4 * scale  # one decoding step


@torch.no_grad()
def _kvzip_masked_and_ragged(model, ids, fed, ratio):
    """kvpress's ``KVzipPress`` as shipped: the logits of ``fed`` (a question, then one decoding step) on its masked
    cache (its attention patch's fake keys), and on a ragged cache of exactly the entries its mask keeps."""
    layers = language_model(model).layers
    cache = DynamicCache()
    with KVzipPress(compression_ratio=ratio)(model):
        model.model(input_ids=ids, past_key_values=cache)
    keep = masked_keep(layers, ids.shape[1])
    ragged = copy.deepcopy(cache)
    for layer_idx in range(len(ragged.layers)):
        evict_ragged(ragged, layer_idx, keep[layer_idx])
    n, t = ids.shape[1], fed.shape[1]
    out = []
    for c in (cache, ragged):
        first = model(input_ids=fed[:, :-1], past_key_values=c, position_ids=torch.arange(n, n + t - 1)[None]).logits
        last = model(input_ids=fed[:, -1:], past_key_values=c, position_ids=torch.tensor([[n + t - 1]])).logits
        out.append(torch.cat([first[0], last[0]]))
    for layer in layers:
        del layer.self_attn.masked_key_indices
    return keep, *out


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_logits_match_kvpress_kvzip_on_its_kept_entries(ratio):
    model = tiny_model("llama")
    keep, masked, ragged = _kvzip_masked_and_ragged(model, random_ids(N, seed=7), random_ids(5, seed=8), ratio)
    counts = keep.sum(-1)
    assert counts.min() < counts.max()  # kvpress's heads keep different counts
    assert abs(keep.double().mean() - (1 - ratio)) < 0.05
    assert (ragged - masked).abs().max() <= 1e-4 * masked.abs().max()


class _KeepPress(BasePress):
    """A test press: after each layer's prefill, its cache layer becomes a RaggedLayer holding ``keep[layer]``."""

    def __init__(self, keep):
        self.keep = keep

    def forward_hook(self, module, input, kwargs, output):
        cache = kwargs["past_key_values"]
        if kwargs["cache_position"][-1] + 1 == kwargs["hidden_states"].shape[1]:  # the prefill
            evict_ragged(cache, module.layer_idx, self.keep[module.layer_idx])
        return output


@torch.no_grad()
def _reference_answer(model64, ids, question, keep, tokens: int) -> list[int]:
    """Greedy answer on the float64 dense cache restricted to ``keep``: the question at positions n.., then
    one token at a time."""
    answer: list[int] = []
    for _ in range(tokens):
        fed = torch.cat([question, torch.tensor([answer], dtype=torch.long).view(1, -1)], dim=1)
        answer.append(int(dense_reference(model64, ids, fed, keep)[-1].argmax()))
    return answer


def test_pipeline_and_generate_answer_as_the_reference(tokenizer):
    """Two questions through kvpress's pipeline (the second answers only if the first answer was cropped away), and
    ``model.generate`` on a fresh ragged cache, against greedy answers on the float64 dense reference."""
    model = tiny_model("llama")
    model64 = float64_copy(model)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context, questions = tokenizer.decode(random_ids(40, seed=10)[0]), ["What is it?", "Say it again."]
    inputs = pipe.preprocess(context, questions, answer_prefix="", max_context_length=10**6)
    context_ids = inputs["context_ids"]
    n = context_ids.shape[1]
    keep = _keep(model, n, seed=9)
    with greedy_margins(model) as margins:
        answers = pipe(context, questions=questions, press=_KeepPress(keep), max_new_tokens=4)["answers"]
    assert min(margins) > TIE
    for question_ids, answer in zip(inputs["questions_ids"], answers):
        expected = _reference_answer(model64, context_ids, question_ids, keep, 4)
        assert answer == tokenizer.decode(expected, skip_special_tokens=True)
        # generate: the new tokens' positions come from get_seq_length(), the context's length, not a kept count
        fed = torch.cat([context_ids, question_ids], 1)
        generated = model.generate(fed, attention_mask=torch.ones_like(fed), past_key_values=_ragged_cache(model, context_ids, keep),
                                   max_new_tokens=4, do_sample=False, eos_token_id=None)
        assert generated[0, fed.shape[1]:].tolist() == expected


def test_bytes_are_exactly_the_kept_entries_and_deepcopy_is_independent():
    model = tiny_model("qwen3")
    ids, keep = random_ids(N, seed=3), _keep(model, N, seed=3)
    cache = _ragged_cache(model, ids, keep)
    d = model.config.head_dim
    for layer_idx, layer in enumerate(cache.layers):
        assert isinstance(layer, RaggedLayer)
        assert layer.nbytes() == 2 * int(keep[layer_idx].sum()) * d * 4  # K and V, float32, no bias, no slack
        assert layer.get_seq_length() == N and layer.keys.shape == (1, 2, N, d)
    copied = copy.deepcopy(cache)
    with torch.no_grad():
        model(input_ids=random_ids(3, seed=4), past_key_values=copied, position_ids=torch.arange(N, N + 3)[None])
    assert copied.get_seq_length() == N + 3 and cache.get_seq_length() == N
    assert cache.layers[0].nbytes() == 2 * int(keep[0].sum()) * d * 4


def test_a_bias_is_stored_at_the_kept_entries_and_an_all_zero_bias_is_not():
    cache = DynamicCache()
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g), 0)
    cache.update(torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g), 1)
    keep = torch.rand(1, 2, 10, generator=g) < 0.5
    bias = torch.randn(1, 2, 10, generator=g)
    layer = evict_ragged(cache, 0, keep, bias)
    assert torch.equal(torch.cat([layer.head(h)[2] for h in range(2)]), bias[0][keep[0]])
    assert evict_ragged(cache, 1, keep, torch.zeros(1, 2, 10)).bias is None


def test_prefix_writes_crop_the_appended_tokens_and_the_rest_is_refused():
    model = tiny_model("llama")
    cache = _ragged_cache(model, random_ids(N, seed=1), _keep(model, N))
    with torch.no_grad():
        model(input_ids=random_ids(4, seed=2), past_key_values=cache, position_ids=torch.arange(N, N + 4)[None])
    layer = cache.layers[0]
    layer.keys = layer.keys[:, :, : N + 1]  # kvpress's pipeline drops an answer so
    layer.values = layer.values[:, :, : N + 1]
    assert layer.get_seq_length() == N + 1
    cache.crop(N)
    assert cache.get_seq_length() == N
    with pytest.raises(ValueError, match="inside its compressed context"):
        layer.keys = layer.keys[:, :, : N - 1]
    with pytest.raises(TypeError, match="prefix slice"):
        layer.keys = torch.zeros(1, 2, N, 16)
    with pytest.raises(AttributeError, match="not a tensor"):
        layer.keys.numel()
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="num_return_sequences"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match="already a RaggedLayer"):
        evict_ragged(cache, 0, torch.ones(1, 2, N, dtype=torch.bool))
    dense = DynamicCache()
    dense.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0)
    with pytest.raises(ValueError, match="keep must be a bool tensor"):
        evict_ragged(dense, 0, torch.ones(1, 2, 4, dtype=torch.bool))


def test_eager_attention_refuses_a_ragged_layer():
    model = tiny_model("llama")
    cache = _ragged_cache(model, random_ids(N, seed=1), _keep(model, N))
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="ragged attention route"), torch.no_grad():
        model(input_ids=random_ids(1, seed=2), past_key_values=cache, position_ids=torch.tensor([[N]]))
