"""Offline RULER generator and kvpress' hub set loader (no network: hub calls get local fixtures)."""

import json
import re
from collections import Counter

import pandas as pd
import pytest
from transformers import AutoTokenizer

from evaluation.tasks import FRAME_COLUMNS, count_tokens, load_dataset_frame
from evaluation.tasks.ruler import offline as ruler
from evaluation.tasks.ruler.niah import NIAH_SPECS, split_sentences
from evaluation.tasks.ruler.offline import OFFLINE_TASKS, fit_size, generate_ruler, spread_examples
from evaluation.tasks.ruler.text import NOISE
from evaluation.tasks.ruler.hub import load_ruler_hub
from kvpress_prob.models import embedded_model_path

LENGTHS = (512, 1024)
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
WORD_KEY_RE = re.compile(r"[a-z]+(?:-[a-z]+)+")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_path())


@pytest.fixture(scope="module")
def frames(tok, tmp_path_factory):
    """Two examples of every offline task at each length in ``LENGTHS``."""
    cache = tmp_path_factory.mktemp("ruler-cache")
    return {n: generate_ruler(tok, n, n_examples=2 * len(OFFLINE_TASKS), seed=0, cache_dir=cache) for n in LENGTHS}


def rows(frames):
    for length, df in frames.items():
        for row in df.itertuples(index=False):
            yield length, row


# --- shape and length ---------------------------------------------------------------------------


def test_columns_types_and_ids(frames):
    for df in frames.values():
        assert list(df.columns) == FRAME_COLUMNS
        assert df["task"].value_counts().to_dict() == {t: 2 for t in OFFLINE_TASKS}
        assert df["example_id"].is_unique
        assert set(df["example_id"]) == {f"{t}-{i}" for t in OFFLINE_TASKS for i in range(2)}
        assert all(isinstance(a, list) and a and all(isinstance(x, str) for x in a) for a in df["answer"])
        family = df["task"].str.split("_").str[0]
        expected = family.map({"niah": 128, "vt": 30, "cwe": 120, "fwe": 50})
        assert (df["max_new_tokens"] == expected).all()


def test_context_fills_target_length(frames, tok):
    for length, row in rows(frames):
        assert row.context_tokens == count_tokens(tok, row.context)
        assert row.context_tokens <= length
        # within 10 %, or within one haystack line for the needle haystacks (a uuid line is ~85 tokens)
        slack = 100 if row.task in ("niah_multikey_2", "niah_multikey_3") else 0.1 * length
        assert row.context_tokens >= length - slack, (row.task, row.context_tokens)


# --- task content ---------------------------------------------------------------------------------


def _question_keys(question: str) -> list[str]:
    query = re.search(r"magic \w+ for (.+) mentioned in the provided text", question).group(1)
    return re.split(r", and |, ", query)


SPECS = NIAH_SPECS


@pytest.mark.parametrize("task", list(SPECS))
def test_niah_needles_answers_and_question(frames, task):
    spec = SPECS[task]
    for _, row in rows(frames):
        if row.task != task:
            continue
        needles = NEEDLE_RE.findall(row.context)
        keys = _question_keys(row.question)
        assert len(keys) == spec.num_queries
        # the answer is exactly the values of the queried keys' needles
        assert sorted(v for _, k, v in needles if k in keys) == sorted(row.answer)
        assert len(row.answer) == spec.num_queries * spec.num_values
        assert all(kind == spec.value_kind for kind, _, _ in needles)
        for _, k, v in needles:
            assert (UUID_RE if spec.key_kind == "uuids" else WORD_KEY_RE).fullmatch(k)
            assert UUID_RE.fullmatch(v) if spec.value_kind == "uuids" else re.fullmatch(r"\d{7}", v)
        planted = {k for _, k, _ in needles if k in keys} | {k for _, k, v in needles if v in row.answer}
        assert planted == set(keys)
        # haystack kind
        body = row.context.split("afterwards.\n", 1)[1]
        if spec.haystack == "noise":
            assert NOISE in body and len(needles) == spec.num_keys * spec.num_values
        elif spec.haystack == "essay":
            assert NOISE not in body and len(needles) == max(spec.num_keys, spec.num_queries) * spec.num_values
            assert len(NEEDLE_RE.sub("", body).split()) > 100  # essay words around the needles
        else:  # every line is a needle, one of them with the queried key
            lines = body.strip().split("\n")
            assert all(NEEDLE_RE.fullmatch(line) for line in lines) and len(lines) > 3
            assert sum(k in keys for _, k, _ in needles) == 1
        # wording: singular for one key and one value
        singular = spec.num_queries * spec.num_values == 1
        kind = spec.value_kind[:-1] if singular else spec.value_kind
        start = "What is the" if singular else "What are all the"
        assert row.question.startswith(f"{start} special magic {kind} for ")
        assert row.answer_prefix.startswith(f"The special magic {kind} for ")
        assert row.context.startswith("A special magic" if singular else "Some special magic")


def test_vt_chain(frames):
    for _, row in rows(frames):
        if row.task != "vt":
            continue
        value = re.search(r"assigned the value (\d{5}) in the text above", row.question).group(1)
        names = row.answer
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        assert f"VAR {names[0]} = {value}" in row.context
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a}" in row.context
        assert f"5 variables are assigned the value {value}, they are:" in row.answer_prefix


def _main_section(context: str, marker: str) -> str:
    return context.rsplit(marker, 1)[1]


def test_cwe_answers_are_the_ten_most_common(frames):
    for _, row in rows(frames):
        if row.task != "cwe":
            continue
        listed = re.findall(r"\d+\. (\S+)", _main_section(row.context, "Memorize the ones that appear most often.\n"))
        counts = Counter(listed)
        assert len(row.answer) == 10
        others = [c for w, c in counts.items() if w not in row.answer]
        assert min(counts[w] for w in row.answer) > max(others)
        assert row.question.startswith("Question: What are the 10 most common words")


def test_fwe_answers_are_the_three_most_frequent(frames):
    for _, row in rows(frames):
        if row.task != "fwe":
            continue
        words = _main_section(row.context, "most frequently appeared coded words. ").split()
        counts = Counter(w for w in words if w != "...")
        assert len(row.answer) == 3
        others = [c for w, c in counts.items() if w not in row.answer]
        assert min(counts[w] for w in row.answer) > max(others)


# --- determinism, spread, cache -------------------------------------------------------------------


def test_deterministic_per_seed(tok, frames):
    again = generate_ruler(tok, 512, n_examples=22, seed=0, use_cache=False)
    pd.testing.assert_frame_equal(again, frames[512])
    other = generate_ruler(tok, 512, n_examples=22, seed=1, use_cache=False)
    assert (other["context"] != frames[512]["context"]).mean() > 0.9


def test_task_examples_do_not_depend_on_other_tasks(tok, frames):
    alone = generate_ruler(tok, 512, n_examples=2, seed=0, tasks=["vt"], use_cache=False)
    pd.testing.assert_frame_equal(alone, frames[512][frames[512]["task"] == "vt"].reset_index(drop=True))


def test_ruler_130_spread(tok):
    counts = spread_examples(130, OFFLINE_TASKS, seed=0)
    assert sum(counts.values()) == 130 and max(counts.values()) - min(counts.values()) <= 1
    assert spread_examples(130, OFFLINE_TASKS, seed=0) == counts
    assert any(spread_examples(130, OFFLINE_TASKS, seed=s) != counts for s in range(1, 5))  # seeded remainder
    df = generate_ruler(tok, 512, seed=0, use_cache=False)
    per_task = df["task"].value_counts()
    assert len(df) == 130 and set(per_task.index) == set(OFFLINE_TASKS)
    assert per_task.max() - per_task.min() <= 1
    assert per_task.to_dict() == counts


def test_cache_round_trip(tok, tmp_path, monkeypatch):
    df = generate_ruler(tok, 512, n_examples=11, seed=3, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".jsonl" and not list(tmp_path.glob("*.tmp*"))

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated instead of reading the cache")

    monkeypatch.setattr(ruler, "_builders", no_generation)
    cached = generate_ruler(tok, 512, n_examples=11, seed=3, cache_dir=tmp_path)
    pd.testing.assert_frame_equal(cached, df)
    assert isinstance(cached["answer"].iloc[0], list)
    with pytest.raises(AssertionError, match="regenerated"):  # other arguments, other key
        generate_ruler(tok, 512, n_examples=11, seed=4, cache_dir=tmp_path)


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))
    assert ruler.default_cache_dir() == tmp_path / "ruler"


# --- errors and small helpers --------------------------------------------------------------------


def test_unknown_task_and_too_short(tok):
    with pytest.raises(ValueError, match="niah_single_1"):
        generate_ruler(tok, 512, tasks=["niah_single_9"], use_cache=False)
    with pytest.raises(ValueError, match="too small"):
        generate_ruler(tok, 40, n_examples=1, tasks=["niah_single_1"], use_cache=False)


def test_qa_tasks_without_hub_raise_clear_error(tok):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    with pytest.raises(RuntimeError, match="Hugging Face hub.*niah_single_1"):
        generate_ruler(tok, 512, n_examples=2, tasks=["qa_1"], use_cache=False, load_fn=offline)


def fake_qa_load(name, *args, **kwargs):
    """A few rows of SQuAD v2 / HotpotQA distractor in the hub's schemas."""
    if name == "rajpurkar/squad_v2":
        rows = []
        for i in range(30):
            rows.append({
                "id": str(i), "title": f"Title{i % 5}",
                "context": f"Paragraph {i} tells that the capital of land {i} is City{i}. " * 3,
                "question": f"What is the capital of land {i}?",
                "answers": {"text": [f"City{i}"] if i % 7 else [], "answer_start": [0] if i % 7 else []},
            })
        return pd.DataFrame(rows)
    assert name == "hotpotqa/hotpot_qa" and args == ("distractor",)
    return pd.DataFrame([
        {"id": str(i), "question": f"Which river crosses town {i}?", "answer": f"River{i}",
         "context": {"title": [f"Town{i}", f"Other{i}"],
                     "sentences": [[f"Town{i} lies on River{i}. ", "It is old."], [f"Other{i} is a hill."]]}}
        for i in range(30)
    ])


def test_qa_tasks_with_a_local_source(tok):
    df = generate_ruler(tok, 512, n_examples=4, tasks=["qa_1", "qa_2"], use_cache=False, load_fn=fake_qa_load)
    assert df["task"].tolist() == ["qa_1", "qa_1", "qa_2", "qa_2"]
    for row in df.itertuples():
        assert row.max_new_tokens == 32 and row.answer_prefix == "Answer:"
        assert all(a in row.context for a in row.answer) and row.context_tokens <= 512
        assert row.question.startswith("Answer the question based on the given documents.")
        assert re.search(r"Question: (What is the capital|Which river)", row.question)
        assert row.context.count("Document ") > 3


def test_split_sentences():
    text = 'He left. "Why?" she asked! It cost 3.5 dollars. 2010 was a year.We keep this one.'
    assert split_sentences(text) == ["He left.", '"Why?" she asked!', "It cost 3.5 dollars.",
                                     "2010 was a year.We keep this one."]


def test_fit_size_finds_largest_fitting():
    def n_tokens(n):
        return 10 * n + 5

    for guess in (1, 50, 99, 100, 5000):
        assert fit_size(n_tokens, 1000, 0, guess) == 99
    with pytest.raises(ValueError, match="too small"):
        fit_size(n_tokens, 4, 0, 10)


# --- kvpress' hub set -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_frame():
    """The hub split's schema and size at 4096 tokens: 13 tasks x 500 rows, grouped by task."""
    tasks = list(OFFLINE_TASKS) + ["qa_1", "qa_2"]
    return pd.DataFrame([
        {"context": f"context {t} {i}", "question": f"question {t} {i}", "answer_prefix": "Answer:",
         "answer": [f"{t}-answer-{i}"], "task": t, "max_new_tokens": 32 if t.startswith("qa") else 128}
        for t in tasks for i in range(500)
    ])


def test_hub_loader_reproduces_kvpress_sample(hub_frame, tmp_path):
    path = tmp_path / "ruler-4096.jsonl"
    with open(path, "w") as f:
        for record in hub_frame.to_dict("records"):
            f.write(json.dumps(record) + "\n")
    df = load_ruler_hub(4096, path=path)
    expected = hub_frame.sample(frac=0.02, random_state=42)  # what kvpress evaluates
    assert len(df) == 130
    assert df["context"].tolist() == expected["context"].tolist()
    assert df["answer"].tolist() == expected["answer"].tolist()
    assert df["example_id"].tolist() == [f"{t}-{i}" for t, i in zip(expected["task"], expected.index)]
    assert df["task"].nunique() > 1 and list(df.columns) == [c for c in FRAME_COLUMNS if c != "context_tokens"]

    parquet = tmp_path / "ruler-4096.parquet"
    hub_frame.to_parquet(parquet)
    pd.testing.assert_frame_equal(load_ruler_hub(4096, path=parquet), df)


def test_hub_loader_with_load_fn(hub_frame, tok):
    calls = []

    def load_fn(name, **kwargs):
        calls.append((name, kwargs))
        return hub_frame

    df = load_dataset_frame("ruler-hub", tok, load_fn=load_fn, tasks=["vt", "cwe"])
    assert calls == [("simonjegou/ruler", {"data_dir": "4096", "split": "test"})]
    assert set(df["task"]) <= {"vt", "cwe"} and len(df) > 0
    assert (df["context_tokens"] == [count_tokens(tok, c) for c in df["context"]]).all()

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'simonjegou/ruler' on the Hub")

    with pytest.raises(RuntimeError, match="Hugging Face hub"):
        load_ruler_hub(4096, load_fn=offline)


def test_dispatcher_ruler_and_unknown_name(tok, tmp_path):
    df = load_dataset_frame("ruler", tok, context_length=512, n_examples=11, cache_dir=tmp_path)
    assert len(df) == 11 and set(df["task"]) == set(OFFLINE_TASKS)
    with pytest.raises(ValueError, match="ruler, ruler-hub, longbench"):
        load_dataset_frame("babilong", tok)
