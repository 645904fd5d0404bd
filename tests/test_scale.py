"""Long contexts: proposals and scores computed inside one prefill's hooks, H2O's chunked scores,
bounded batched-decoding memory, and layers placed by a device map."""

import gc
import json

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import ChunkKVPress, KVPressTextGenerationPipeline, SnapKVPress
from test_proposals import eager_attention, layer_inputs
from test_runner import FAMILIES, examples
from transformers import DynamicCache

from evaluation.engine import Compressed, Prefill, plan, press_prefill, stack
from evaluation.engine.runner import Config, configurations, run
from evaluation.store.results import ResultStore
from kvpress_prob.proposals.attention import chunk_rows
from kvpress_prob.presses.h2o import EagerObservedAttentionPress
from kvpress_prob.names.registry import get_press

STRONGER = ["adakv_snapkv", "expected_attention", "keydiff", "lagkv", "adakv_tova"]


def test_announced_presses_share_one_prefill_and_match_the_pipeline(tokenizer):
    """Every family announced up front: one sdpa prefill (plus H2O's eager one) computes every
    proposal and score; nothing the size of a layer's hidden states is kept; each configuration
    answers as kvpress's pipeline from scratch. A press of no known family (ChunkKV) has a prefill of its own."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    row = examples(1).iloc[0]
    inputs = pipe.preprocess(row.context, [row.question], row.answer_prefix, 10**9)
    n = inputs["context_ids"].shape[1]
    configs = configurations(FAMILIES + STRONGER, [0.25, 0.75], [1])
    shared = Prefill(model, inputs["context_ids"], [cfg.build() for cfg in configs])
    assert shared.prefills == 2  # sdpa + H2O's eager one
    # stored score tensors, one (1, H_kv, n) per layer and distinct scorer or proposal, whatever the ratio:
    # the scores of snapkv (and adakv_snapkv), tova (and adakv_tova), knorm, expected_attention, keydiff,
    # lagkv, H2O's eager ones, StreamingLLM's at each ratio (its scores read it); the proposals of
    # prob_min_h (topk_min_h, _coord, _strata, _ht: one proposal), prob_snapkv, prob_h2o_h_nocorr
    assert len(shared.stored) == 6 + 1 + 2 + 3
    assert sum(len(table) for table in shared.stored.values()) == 12 * model.config.num_hidden_layers
    hidden = model.config.hidden_size
    kept = [t for table in shared.stored.values() for t in table.values()]
    assert kept and all(t.shape[-1] == n and t.shape[-2] == model.config.num_key_value_heads for t in kept)
    assert not any(isinstance(v, torch.Tensor) and v.shape[-1] == hidden for v in vars(shared).values())
    other = ChunkKVPress(press=SnapKVPress(compression_ratio=0.5), chunk_length=8)
    assert plan(model, other, n).kind == "prefill"
    for cfg in configs[1::2] + [None]:
        press = other if cfg is None else cfg.build()
        if cfg is not None and cfg.press.startswith(("adakv", "expected")):  # AdaKV's fake keys fail on random
            shared.compress(press)  # weights when decoding: compare its masks with a prefill under the press
            ours = [layer.self_attn.masked_key_indices for layer in shared.layers]
            press_prefill(model, inputs["context_ids"], cfg.build())
            for mine, theirs in zip(ours, (layer.self_attn.masked_key_indices for layer in shared.layers)):
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), cfg
            continue
        ours = pipe.generate_answer(inputs["questions_ids"][0], shared.compress(press), n, 6)
        reference = pipe(row.context, question=row.question, answer_prefix=row.answer_prefix,
                         press=other if cfg is None else cfg.build(), max_new_tokens=6)["answer"]
        assert ours == reference, cfg
    assert shared.prefills == 2  # nothing announced was computed again


def test_unannounced_press_costs_one_more_prefill(tokenizer):
    model = tiny_model("qwen3")
    shared = Prefill(model, random_ids(90), [get_press("snapkv", 0.5)])
    shared.compress(get_press("snapkv", 0.5))
    assert shared.prefills == 1
    shared.compress(get_press("prob_min_h", 0.5))
    shared.compress(get_press("prob_min_h", 0.25, seed=3))  # same proposal: no new prefill
    assert shared.prefills == 2


def test_h2o_chunked_scores_match_eager_attention(model):  # eager weights in float32: rounding only
    """Above max_eager_bytes the H2O baseline computes kvpress's ObservedAttention scores from the
    queries in chunks, without eager attention: the same scores as the dense reference."""
    module, hidden, keys, values, kwargs = layer_inputs(model)
    n = keys.shape[2]
    press = EagerObservedAttentionPress(compression_ratio=0.5, max_eager_bytes=0, chunk_size=9)
    chunked = press.score(module, hidden, keys, values, None, kwargs)  # (1, H_kv, n)
    A = eager_attention(model)[None]  # (1, H_q, n, n): the model's own eager weights, same ids
    eager = press.score(module, hidden, keys, values, A, kwargs)
    torch.testing.assert_close(chunked, eager, rtol=1e-5, atol=1e-7)
    assert press.eager_bytes(model, n) == model.config.num_attention_heads * n * n * 4
    assert not press.eager_fits(model, n) and EagerObservedAttentionPress(compression_ratio=0.5).eager_fits(model, n)
    with pytest.raises(ValueError, match="max_eager_bytes"):
        EagerObservedAttentionPress(max_eager_bytes=-1)


def test_h2o_above_the_limit_never_runs_eager_and_the_runner_matches(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, k, o: seen.append(m.config._attn_implementation), with_kwargs=True)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    row = examples(1).iloc[0]
    inputs = pipe.preprocess(row.context, [row.question], row.answer_prefix, 10**9)
    n = inputs["context_ids"].shape[1]
    small = get_press("h2o", 0.5, max_eager_bytes=0)
    shared = Prefill(model, inputs["context_ids"], [small])
    assert shared.prefills == 1 and shared._eager is None  # scored in the shared sdpa prefill
    ours = pipe.generate_answer(inputs["questions_ids"][0], shared.compress(small), n, 6)
    reference = pipe(row.context, question=row.question, answer_prefix=row.answer_prefix,
                     press=get_press("h2o", 0.5, max_eager_bytes=0), max_new_tokens=6)["answer"]
    hook.remove()
    assert ours == reference and "eager" not in seen and model.config._attn_implementation == "sdpa"


def test_pi_min_h_chunk_is_bounded_by_the_kv_size():
    keys = torch.zeros(1, 3, 8192, 64)  # one layer of SmolLM2-135M at 8k, float32
    rows = chunk_rows(keys, n_query_heads=9, n_layers=30)
    kv = 30 * 2 * keys.numel() * 4
    assert rows == 40 and 9 * rows * 8192 * 4 <= kv / 32
    assert chunk_rows(keys.to(torch.bfloat16), 9, 1) == 1  # never 0


def real_tensors():
    """The tensors alive in Python that own memory: fake or functional tensors left by an earlier
    trace (FlexAttention, torch.compile) have no data pointer and hold no bytes."""
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            yield obj


def live_bytes(exclude: set) -> int:
    """Bytes of the distinct storages of the tensors alive in Python, except those in ``exclude``."""
    seen, total = set(exclude), 0
    for obj in real_tensors():
        storage = obj.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def test_stack_peaks_at_the_caches_plus_one_layer(monkeypatch):
    """Live tensor bytes while ``stack`` copies B caches layer by layer: never more than the final
    batched cache plus one layer's stack (holding the B caches and the stack would add the caches)."""
    import evaluation.engine as engine

    gc.collect()
    before = {t.untyped_storage().data_ptr() for t in real_tensors()}
    g = torch.Generator().manual_seed(0)
    layers, heads, d, room = 6, 2, 16, 5
    items = [Compressed([torch.randn(1, heads, s, d, generator=g) for _ in range(layers)],
                        [torch.randn(1, heads, s, d, generator=g) for _ in range(layers)],
                        [torch.randn(1, heads, s, generator=g) if i else None for _ in range(layers)])
             for i, s in enumerate([300, 280, 310, 150])]
    items_bytes = live_bytes(before)
    per_layer = len(items) * heads * ((310 + room) * 2 * d + 310) * 4  # keys, values with room, bias
    peaks = []
    original = engine.RoomyLayer.__init__

    def measured(self, *args):
        original(self, *args)
        peaks.append(live_bytes(before))

    monkeypatch.setattr(engine.RoomyLayer, "__init__", measured)
    cache, biases = stack(items, room)
    assert len(peaks) == layers
    assert max(peaks) <= layers * per_layer + per_layer
    assert max(peaks) < items_bytes + layers * per_layer - per_layer  # the old bound: both held at once
    assert all(item.keys == [None] * layers for item in items)


def test_runner_decodes_the_full_reference_alone(tmp_path, tokenizer, monkeypatch):
    """The full cache decodes apart from the compressed configurations (never padded together)."""
    import evaluation.engine.runner as runner

    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    batches = []
    original = runner.generate_batch

    def spy(model, tokenizer, question_ids, items, n, max_new):
        batches.append([item.keys[0].shape[2] for item in items])
        return original(model, tokenizer, question_ids, items, n, max_new)

    monkeypatch.setattr(runner, "generate_batch", spy)
    store = ResultStore(tmp_path / "r.jsonl")
    configs = configurations(["snapkv", "prob_min_h"], [0.5], [0, 1])
    run(model, tokenizer, examples(1), configs, store, model_name="tiny", dataset="ruler", data_dir="x",
        decode_batch=8, progress=False)
    n = max(max(b) for b in batches) * 2
    assert batches and all(len(b) == 3 and max(b) < n for b in batches)
    assert len(store.load()) == 4


def device_map_model(tmp_path, tokenizer):
    """A tiny model saved and reloaded through ``load_model`` with an explicit per-layer device map."""
    from kvpress_prob.models import load_model

    tiny = tiny_model("llama")
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    layout = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
              **{f"model.layers.{i}": "cpu" for i in range(3)}}
    model, tok = load_model(str(tmp_path / "tiny"), device_map=layout)
    model.generation_config.eos_token_id = 2
    return model, tok, layout


def test_device_map_runs_through_load_model_and_the_runner(tmp_path, tokenizer):
    """An explicit per-layer map over "cpu", with accelerate's hooks forced on every mapped module (as
    a map over several GPUs installs them: each moves its inputs to its device): the runner's
    predictions are those of the same model on one device."""
    from accelerate import dispatch_model

    model, tok, layout = device_map_model(tmp_path, tokenizer)
    assert all(p.device.type == "cpu" for p in model.parameters())
    dispatch_model(model, device_map=layout, force_hooks=True)
    assert hasattr(model.model.layers[1], "_hf_hook")

    plain = tiny_model("llama")
    plain.generation_config.eos_token_id = 2
    configs = configurations(["snapkv", "prob_min_h", "adakv_snapkv"], [0.5], [0])
    kwargs = dict(model_name="tiny", dataset="ruler", data_dir="x", progress=False, decode_batch=3)
    mapped, reference = ResultStore(tmp_path / "a.jsonl"), ResultStore(tmp_path / "b.jsonl")
    run(model, tok, examples(1), configs, mapped, **kwargs)
    run(plain, tokenizer, examples(1), configs, reference, **kwargs)
    key = ["press", "seed"]
    assert mapped.load().set_index(key).prediction.sort_index().equals(reference.load().set_index(key).prediction.sort_index())


def test_cli_takes_a_device_map():
    from evaluation.cli import parser

    args = parser().parse_args(["run", "--device-map", json.dumps({"model.layers.0": "cpu"}), "--presses", "snapkv",
                                "--out", "x"])
    assert json.loads(args.device_map) == {"model.layers.0": "cpu"}
