"""LongBench loader on local fixtures in LongBench's schemas (no network)."""

import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from evaluation.tasks import FRAME_COLUMNS, count_tokens, load_dataset_frame
from evaluation.tasks.longbench import load_longbench
from kvpress_prob.models import embedded_model_path

SHORT_PASSAGES = "Passage 1:\nAda Lovelace\nAda wrote the first program.\n\nPassage 2:\nCharles Babbage\nHe designed engines."
LONG_CONTEXT = "The analytical engine was a proposed mechanical computer. " * 400  # ~4000 tokens

# THUDM LongBench rows: input, context, answers, length, dataset, language, all_classes, _id
RAW_ROWS = {
    "hotpotqa": [
        {"input": "Who wrote the first program?", "context": SHORT_PASSAGES, "answers": ["Ada Lovelace"],
         "length": 20, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "hp-short"},
        {"input": "What was proposed?", "context": LONG_CONTEXT, "answers": ["a mechanical computer"],
         "length": 3200, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "hp-long"},
    ],
    "qasper": [
        {"input": "Which dataset is used?", "context": "Abstract\nWe use SQuAD.", "answers": ["SQuAD", "squad v1"],
         "length": 5, "dataset": "qasper", "language": "en", "all_classes": None, "_id": "qa-short"},
    ],
    "triviaqa": [
        {"input": "Passage: Paris is in France.\nQuestion: Which country is Paris in?\nAnswer:",
         "context": "Passage: Rome is in Italy.\nQuestion: Which country is Rome in?\nAnswer: Italy",
         "answers": ["France", "French Republic"], "length": 30, "dataset": "triviaqa", "language": "en",
         "all_classes": None, "_id": "tq-short"},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_path())


@pytest.fixture
def load_fn(tmp_path):
    """A ``datasets.load_dataset`` stand-in reading the fixture rows from jsonl files in ``tmp_path``."""
    for task, rows in RAW_ROWS.items():
        with open(tmp_path / f"{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def load(name, data_dir, split):
        assert (name, split) == ("Xnhyacinth/LongBench", "test")
        return pd.read_json(tmp_path / f"{data_dir}.jsonl", lines=True, dtype=False)

    return load


def test_hotpotqa_split_and_length_filter(tok, load_fn):
    assert count_tokens(tok, LONG_CONTEXT) > 3000  # the fixture's long row really is long
    df = load_longbench("hotpotqa", tok, load_fn=load_fn)
    assert list(df.columns) == FRAME_COLUMNS
    assert df["example_id"].tolist() == ["hp-short"]  # the long row is dropped
    row = df.iloc[0]
    instruction = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    assert row.context == f"{instruction}\n\nThe following are given passages.\n{SHORT_PASSAGES}\n\n{instruction}\n\n"
    assert "Question:" not in row.context
    assert row.question == "Question: Who wrote the first program?\n"
    assert row.answer_prefix == "Answer:"
    assert row.answer == ["Ada Lovelace"] and row.task == "hotpotqa" and row.max_new_tokens == 32
    assert row.context_tokens == count_tokens(tok, row.context) < 3000
    # a higher threshold keeps the long row
    assert load_longbench("hotpotqa", tok, max_context_tokens=10_000, load_fn=load_fn)["example_id"].tolist() == [
        "hp-short", "hp-long"]


def test_qasper_split(tok, load_fn):
    row = load_longbench("qasper", tok, load_fn=load_fn).iloc[0]
    assert row.context.startswith("You are given a scientific article and a question.")
    assert "Article: Abstract\nWe use SQuAD.\n\n Answer the question based on the above article" in row.context
    assert row.context.endswith("Do not provide any explanation.\n\n")
    assert row.question == "Question: Which dataset is used?\n\n"
    assert row.answer_prefix == "Answer:" and row.max_new_tokens == 128
    assert row.answer == ["SQuAD", "squad v1"]


def test_triviaqa_split(tok, load_fn):
    row = load_longbench("triviaqa", tok, load_fn=load_fn).iloc[0]
    raw = RAW_ROWS["triviaqa"][0]
    assert row.context == (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n" + raw["context"] + "\n\n"
    )
    assert row.question == "Passage: Paris is in France.\nQuestion: Which country is Paris in?\n"
    assert row.answer_prefix == "Answer:" and row.max_new_tokens == 32
    # context + question + answer prefix is LongBench's own prompt
    assert row.context + row.question + row.answer_prefix == row.context + raw["input"]


def test_kvpress_preprocessed_schema_gives_the_same_frame(tok, load_fn):
    """kvpress pushed already-split rows (context, question, answer_prefix, answers, _id, ...) to the hub."""
    raw = load_fn("Xnhyacinth/LongBench", data_dir="hotpotqa", split="test")
    mine = load_longbench("hotpotqa", tok, max_context_tokens=10_000, load_fn=load_fn)
    pre = raw.drop(columns=["input"]).assign(
        context=mine["context"].to_numpy(), question=mine["question"].to_numpy(),
        answer_prefix="Answer:", task="hotpotqa", max_new_tokens=52,
    )
    again = load_longbench("hotpotqa", tok, max_context_tokens=10_000, load_fn=lambda *a, **k: pre)
    pd.testing.assert_frame_equal(again, mine)


def test_dispatcher_concatenates_tasks(tok, load_fn):
    df = load_dataset_frame("longbench", tok, load_fn=load_fn)
    assert df["task"].tolist() == ["hotpotqa", "qasper", "triviaqa"]
    assert df["example_id"].is_unique
    subset = load_dataset_frame("longbench", tok, load_fn=load_fn, tasks=["triviaqa"])
    assert subset["example_id"].tolist() == ["tq-short"]


def test_errors(tok, load_fn):
    with pytest.raises(ValueError, match="hotpotqa, qasper, triviaqa"):
        load_longbench("narrativeqa", tok, load_fn=load_fn)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Xnhyacinth/LongBench' on the Hub")

    with pytest.raises(RuntimeError, match="Hugging Face hub"):
        load_longbench("qasper", tok, load_fn=offline)
