"""The runner sizes its decode batch from the free device memory (issue 27 item 3): a simulated small
device, whose free memory is set, never sees a batch whose projected peak exceeds it, and a larger
one decodes more configurations at once; an explicit ``decode_batch`` is used as given."""

import pytest
import torch
from conftest import tiny_model
from test_runner import examples

import evaluation.engine.runner as runner_module
from evaluation.engine import sizing
from evaluation.engine.runner import configurations, run
from evaluation.store.results import ResultStore

KWARGS = dict(model_name="tiny", dataset="ruler", data_dir="64", progress=False)


def batches(monkeypatch, tmp_path, tokenizer, decode_batch, free):
    """Run 6 configurations (ratios 0.1..0.9, padded batches) of one example; return, for each
    decoded batch, (its size, the bytes it held at its peak as ``BatchSizer`` projects them)."""
    model = tiny_model("llama")
    configs = [c for c in configurations(["snapkv", "prob_snapkv"], [0.1, 0.5, 0.9], [0]) if c.press != "full"]
    seen, original = [], runner_module.generate_batch

    def spy(model, tokenizer, question_ids, items, context_length, max_new_tokens):
        room = question_ids.shape[1] + max_new_tokens
        full = 768 * context_length  # 3 layers x (keys, values) x 2 heads x 16 dims x 4 bytes per token
        peak = (sum(map(sizing.item_bytes, items)) + sizing.stacked_bytes(items, room) + sizing.PADDING * full
                + 4 * len(items) * model.config.vocab_size)  # the batch, the next item held, the logits
        seen.append((len(items), peak))
        return original(model, tokenizer, question_ids, items, context_length, max_new_tokens)

    monkeypatch.setattr(runner_module, "generate_batch", spy)
    store = ResultStore(tmp_path / f"{decode_batch}-{free}.jsonl")
    assert run(model, tokenizer, examples(1), configs, store, decode_batch=decode_batch,
               free_memory=lambda device: free, **KWARGS) == 6
    assert sum(size for size, _ in seen) == 6  # every configuration decoded once
    return seen


def test_a_small_device_gets_small_batches_within_its_memory(monkeypatch, tmp_path, tokenizer):
    roomy = batches(monkeypatch, tmp_path, tokenizer, "auto", 2**30)
    assert [size for size, _ in roomy] == [6]  # everything fits: one batch
    small = int(0.6 * roomy[0][1] / (1 - sizing.RESERVE))  # 60 % of what the batch of 6 needs
    tight = batches(monkeypatch, tmp_path, tokenizer, "auto", small)
    assert len(tight) > 1 and max(size for size, _ in tight) > 1
    assert all(peak <= (1 - sizing.RESERVE) * small for size, peak in tight if size > 1)  # within the device
    tiny = batches(monkeypatch, tmp_path, tokenizer, "auto", 1000)  # nothing fits: one at a time, never none
    assert [size for size, _ in tiny] == [1] * 6


def test_an_explicit_decode_batch_is_used_as_given(monkeypatch, tmp_path, tokenizer):
    assert [size for size, _ in batches(monkeypatch, tmp_path, tokenizer, 4, 1000)] == [4, 2]
    with pytest.raises(ValueError, match="decode_batch must be >= 1 or 'auto', got 0"):
        run(tiny_model("llama"), tokenizer, examples(1), [], ResultStore(tmp_path / "x.jsonl"), decode_batch=0, **KWARGS)


def test_projection_counts_padding_room_and_the_float32_bias():
    """Two items of 3 and 5 entries, room 2, bfloat16 keys, one float32 bias: the stacked cache pads
    both to 5 + 2 entries, the bias to 5 in float32."""
    from evaluation.engine import Compressed

    k3, k5 = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16)
    items = [Compressed([k3], [k3.clone()], [torch.zeros(1, 2, 3)]), Compressed([k5], [k5.clone()], [None])]
    assert sizing.item_bytes(items[0]) == 2 * (2 * 3 * 4 * 2) + 2 * 3 * 4
    assert sizing.stacked_bytes(items, room=2) == 2 * 2 * ((5 + 2) * (4 + 4) * 2 + 5 * 4)
