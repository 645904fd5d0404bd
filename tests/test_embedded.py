"""One integration test on the embedded SmolLM2-135M-Instruct (the default model)."""

import pytest
from kvpress import KVPressTextGenerationPipeline

from test_press import explicit_answer
from test_proposals import ATTENTION_PROPOSALS, check_against_eager

from kvpress_prob import get_press, load_model

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@pytest.fixture(scope="module")
def pipe():
    model, tokenizer = load_model()
    return KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)


def test_embedded_model_finds_a_short_needle(pipe):
    context = NOISE * 6 + "One of the special magic numbers for quiet-river is: 4825163. " + NOISE * 6
    question = "What is the special magic number for quiet-river mentioned in the provided text?"
    prefix = "The special magic number for quiet-river mentioned in the provided text is"
    full = pipe(context, question=question, answer_prefix=prefix, max_new_tokens=12)["answer"]
    assert "4825163" in full
    # a probabilistic press on the real model: at r = 0.25 it loses digits of this needle (' 482.'), so its
    # answer is checked against the greedy decoding written out (AdaKV: the shared-prefill test below)
    inputs = pipe.preprocess(context, [question], prefix, 10**9)
    for name in ("prob_min_h",):
        answer = pipe(context, question=question, answer_prefix=prefix, press=get_press(name, 0.25), max_new_tokens=12)
        assert answer["answer"] == explicit_answer(pipe.model, pipe.tokenizer, get_press(name, 0.25), inputs, 12), name
        assert answer["answer"].strip().startswith("48")  # the needle's first digits survive


def test_attention_proposals_match_the_embedded_models_eager_attention(pipe):
    """pi_min, pi_min-h, H2O and TOVA's scores against SmolLM2's own eager attention weights (64 tokens)."""
    for layer in (0, 15):
        check_against_eager(pipe.model, layer=layer, n=64, proposals=ATTENTION_PROPOSALS)


def test_shared_prefill_equals_the_pipeline_on_the_embedded_model(pipe):
    from evaluation.engine import Compressed, Prefill, generate_batch
    from evaluation.engine.runner import Config

    context = NOISE * 4 + "One of the special magic numbers for bold-lake is: 7301942. " + NOISE * 4
    question, prefix = "What is the special magic number for bold-lake?", "The special magic number is"
    inputs = pipe.preprocess(context, [question], prefix, 10**9)
    shared = Prefill(pipe.model, inputs["context_ids"])
    n = inputs["context_ids"].shape[1]
    references, items = [], []
    for name in ("snapkv", "adakv_snapkv", "prob_min_h"):  # kvpress top-k, masked (AdaKV), sampled and corrected
        cfg = Config(name, 0.5, 0)
        ours = pipe.generate_answer(inputs["questions_ids"][0], shared.compress(cfg.build()), n, 10)
        reference = pipe(context, question=question, answer_prefix=prefix, press=cfg.build(), max_new_tokens=10)
        assert ours == reference["answer"], name
        references.append(reference["answer"])  # AdaKV's masked keys become the lowest bias
        items.append(Compressed.take(shared.compress(cfg.build()), shared.layers))
    # the runner's batched decoding of the same configurations on the real model
    assert generate_batch(pipe.model, pipe.tokenizer, inputs["questions_ids"][0], items, n, 10) == references


def test_a_conversion_that_loses_the_race_keeps_the_winners_copy(tmp_path):
    """Two processes converting the embedded model at once: the second's rename finds the folder made by the
    first, keeps it and leaves no temporary copy behind; a failed rename with no finished copy still raises."""
    from kvpress_prob.models import _publish

    target, tmp = tmp_path / "model", tmp_path / "model.tmp1"
    (target / "sub").mkdir(parents=True)  # a non-empty folder: rename onto it fails
    (target / "config.json").write_text("winner")
    tmp.mkdir()
    (tmp / "config.json").write_text("loser")
    _publish(tmp, target)
    assert (target / "config.json").read_text() == "winner" and not tmp.exists()
    (target / "config.json").unlink()
    tmp.mkdir()
    with pytest.raises(OSError):
        _publish(tmp, target)
