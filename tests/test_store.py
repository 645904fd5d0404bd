"""Tests of evaluation.store.results: JSON-lines results, crash safety, sharding, merging, kvpress folders."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from evaluation.store.results import (
    ResultStore,
    StoreCorruptError,
    merge,
    parse_shard,
    record_key,
    shard,
    write_atomic,
)
from evaluation.store.kvpress_folders import write_kvpress_folder

REPO = Path(__file__).resolve().parents[1]


def make_record(i: int, press: str = "snapkv", ratio: float = 0.5, seed: int = 0, score: float = 50.0) -> dict:
    """A schema-complete record for example i."""
    return {
        "model": "org/tiny", "dataset": "ruler", "data_dir": "4096", "task": "niah_single_1",
        "example_id": f"ex{i}", "press": press, "compression_ratio": ratio, "seed": seed,
        "prediction": f"answer {i}", "answer": [f"answer {i}"], "score": score,
        "realised_ratio": ratio, "kv_bytes": 1000 + i, "seconds": 0.1,
    }


def test_append_load_round_trip(tmp_path):
    store = ResultStore(tmp_path / "sub" / "results.jsonl")
    assert store.load().empty and store.done_keys() == set()
    records = [make_record(i) for i in range(3)]
    store.append(records[:2])
    store.append(records[2:])
    df = ResultStore(store.path).load()
    assert len(df) == 3
    assert df["example_id"].tolist() == ["ex0", "ex1", "ex2"]
    assert df.loc[1, "answer"] == ["answer 1"]
    assert df["compression_ratio"].dtype == float
    assert store.path.read_bytes().endswith(b"\n")
    assert len(store.path.read_text().splitlines()) == 3


def test_numpy_values_are_stored_as_plain_json(tmp_path):
    np = pytest.importorskip("numpy")
    store = ResultStore(tmp_path / "r.jsonl")
    rec = make_record(0) | {"score": np.float64(12.5), "kv_bytes": np.int64(7), "seed": np.int64(3)}
    store.append([rec])
    loaded = json.loads(store.path.read_text())
    assert loaded["score"] == 12.5 and loaded["kv_bytes"] == 7 and loaded["seed"] == 3


def test_truncated_last_line_is_dropped_and_repaired(tmp_path):
    path = tmp_path / "r.jsonl"
    store = ResultStore(path)
    store.append([make_record(0), make_record(1)])
    half = json.dumps(make_record(2))[:40]
    with open(path, "a") as f:  # a writer killed mid-line
        f.write(half)
    # a read-only reader ignores the partial line and does not touch the file
    reader = ResultStore(path, readonly=True)
    assert len(reader.load()) == 2
    assert path.read_text().endswith(half)
    # opening for writing cuts it away, so the next append starts on a fresh line
    store = ResultStore(path)
    assert path.read_text().endswith("\n")
    store.append([make_record(2)])
    lines = path.read_text().splitlines()
    assert [json.loads(line)["example_id"] for line in lines] == ["ex0", "ex1", "ex2"]


def test_whole_file_one_partial_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"model": "m", "exa')
    store = ResultStore(path)
    assert path.read_bytes() == b""
    store.append([make_record(0)])
    assert len(store.load()) == 1


def test_valid_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(make_record(0)))  # hand-written, no final newline
    store = ResultStore(path)
    store.append([make_record(1)])
    assert store.load()["example_id"].tolist() == ["ex0", "ex1"]


def test_corrupt_middle_line_raises(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(make_record(0)) + "\n" + "garbage\n" + json.dumps(make_record(1)) + "\n")
    with pytest.raises(StoreCorruptError, match=r"r\.jsonl:2"):
        ResultStore(path).load()


def test_done_keys_and_duplicates(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.append([make_record(0), make_record(1, press="prob_min_h", seed=2)])
    # the same unit redone after a crash: the first copy wins
    store.append([make_record(0, score=99.0)])
    keys = store.done_keys()
    assert keys == {
        ("org/tiny", "ruler", "4096", "ex0", "snapkv", 0.5, 0),
        ("org/tiny", "ruler", "4096", "ex1", "prob_min_h", 0.5, 2),
    }
    df = store.load()
    assert len(df) == 2 and df.loc[df["example_id"] == "ex0", "score"].item() == 50.0
    # ratio keys are normalised, so a float rounding difference is the same unit
    assert record_key(make_record(0, ratio=0.1 + 0.2)) == record_key(make_record(0, ratio=0.3))


# ----------------------------------------------------------------------------- sharding


def units(n: int = 200) -> list[dict]:
    return [make_record(i, press=p, ratio=r) for i in range(n // 4) for p in ("snapkv", "tova") for r in (0.25, 0.5)]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_partition_the_items(n):
    items = units()
    parts = [shard(items, f"{i}/{n}") for i in range(1, n + 1)]
    keys = [{record_key(u) for u in part} for part in parts]
    assert sum(len(part) for part in parts) == len(items)
    assert set().union(*keys) == {record_key(u) for u in items}
    for a in range(n):
        for b in range(a + 1, n):
            assert not keys[a] & keys[b]
    if n > 1:
        assert all(parts), "every shard gets some of 200 items"


def test_shard_does_not_depend_on_order():
    items = units()
    shuffled = list(reversed(items[::2])) + items[1::2]
    for i in (1, 2, 3):
        assert {record_key(u) for u in shard(items, f"{i}/3")} == {record_key(u) for u in shard(shuffled, f"{i}/3")}
    # the assignment of an item does not depend on the other items either
    assert shard(items[:5], "2/3") == [u for u in shard(items, "2/3") if u in items[:5]]


def test_shard_custom_key_keeps_examples_together():
    items = units()
    part = shard(items, "1/2", key=lambda u: u["example_id"])
    examples = {u["example_id"] for u in part}
    assert len(part) == 4 * len(examples)


def test_shard_plain_tuples_and_none():
    items = [("ex1", "snapkv", 0.5, 0), ("ex2", "snapkv", 0.5, 0), ("ex3", "tova", 0.25, 1)]
    assert sorted(shard(items, "1/2") + shard(items, "2/2")) == sorted(items)
    assert shard(items, None) == items


@pytest.mark.parametrize("spec", ["0/3", "4/3", "3", "a/b", "1/0", "", "1/2/3", "-1/2"])
def test_bad_shard_spec(spec):
    with pytest.raises(ValueError, match=r"--shard.*i/n"):
        parse_shard(spec)
    with pytest.raises(ValueError, match="--shard"):
        shard([1, 2], spec)


def test_parse_shard():
    assert parse_shard("2/4") == (2, 4)
    assert parse_shard(" 1 / 1 ") == (1, 1)


# ----------------------------------------------------------------------------- merge, atomic writes


def test_merge_drops_duplicates(tmp_path):
    a, b = ResultStore(tmp_path / "a.jsonl"), ResultStore(tmp_path / "b.jsonl")
    a.append([make_record(0), make_record(1)])
    b.append([make_record(1, score=0.0), make_record(2)])
    with open(b.path, "a") as f:
        f.write('{"trunc')  # a killed shard
    out = tmp_path / "merged" / "all.jsonl"
    assert merge([a.path, b.path], out) == 3
    df = ResultStore(out).load()
    assert sorted(df["example_id"]) == ["ex0", "ex1", "ex2"]
    assert df.loc[df["example_id"] == "ex1", "score"].item() == 50.0  # the first file wins
    assert not [p for p in out.parent.iterdir() if p.name != "all.jsonl"], "no temporary file left"
    # merging into one of the inputs is allowed
    assert merge([out, a.path], out) == 3


def test_write_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "x" / "f.txt"
    write_atomic(path, "one")
    write_atomic(path, b"two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["f.txt"]


# ----------------------------------------------------------------------------- SIGKILL


WRITER = textwrap.dedent(
    """
    import sys, time
    from evaluation.store.results import ResultStore
    store = ResultStore(sys.argv[1])
    done = store.done_keys()
    i = 0
    while i < int(sys.argv[2]):
        batch = []
        for _ in range(1 + i % 3):          # batches of 1, 2 and 3 records
            batch.append({"model": "m", "dataset": "ruler", "data_dir": "4096", "task": "vt",
                          "example_id": f"ex{i}", "press": "snapkv", "compression_ratio": 0.5,
                          "seed": 0, "prediction": "p" * 5000, "answer": ["a"], "score": float(i),
                          "realised_ratio": 0.5, "kv_bytes": i, "seconds": 0.0})
            i += 1
        store.append(batch)
        time.sleep(0.002)
    """
)


def _expected_keys(n: int) -> set:
    return {("m", "ruler", "4096", f"ex{i}", "snapkv", 0.5, 0) for i in range(n)}


def test_sigkill_mid_run_then_resume(tmp_path):
    n = 3000
    path = tmp_path / "killed.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)], env=env, cwd=REPO)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if path.exists() and path.read_bytes().count(b"\n") >= 30:
                break
            assert proc.poll() is None, "writer exited early"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # every complete line parses; at most the last one is partial
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for line in complete:
        json.loads(line)
    store = ResultStore(path)  # repairs a partial tail
    repaired = path.read_bytes()
    assert repaired.endswith(b"\n")
    assert repaired.startswith(b"".join(line + b"\n" for line in complete))
    df = store.load()
    m = len(df)
    assert 30 <= m < n, "killed mid-way"
    assert m == len(repaired.splitlines()) and m in (len(complete), len(complete) + 1)
    # records were appended in order: what survived is a prefix
    assert df["example_id"].tolist() == [f"ex{i}" for i in range(m)]

    # resume: write only the missing keys, as the runner does
    done = store.done_keys()
    missing = [i for i in range(n) if ("m", "ruler", "4096", f"ex{i}", "snapkv", 0.5, 0) not in done]
    assert len(missing) == n - m
    store.append([{"model": "m", "dataset": "ruler", "data_dir": "4096", "task": "vt", "example_id": f"ex{i}",
                   "press": "snapkv", "compression_ratio": 0.5, "seed": 0, "prediction": "p", "answer": ["a"],
                   "score": float(i), "realised_ratio": 0.5, "kv_bytes": i, "seconds": 0.0} for i in missing])
    final = ResultStore(path)
    assert final.done_keys() == _expected_keys(n)
    assert len(path.read_text().splitlines()) == n
    assert sorted(final.load()["score"]) == [float(i) for i in range(n)]


# ----------------------------------------------------------------------------- kvpress folder


def test_write_kvpress_folder(tmp_path):
    import pandas as pd

    records = [make_record(0, seed=0, score=100.0), make_record(1, seed=0, score=0.0),
               make_record(0, seed=1, score=100.0), make_record(1, seed=1, score=100.0)]
    records[1]["task"] = records[3]["task"] = "vt"
    df = pd.DataFrame(records)
    folder = write_kvpress_folder(tmp_path, df, "ruler", "4096", "org/tiny", "prob_min_h", 0.5,
                                  {"fraction": 0.02, "press_name": "ignored"})
    assert folder.name == "ruler__4096__org--tiny__prob_min_h__0.50"
    predictions = pd.read_csv(folder / "predictions.csv")
    assert {"example_id", "task", "answer", "predicted_answer", "score"} <= set(predictions.columns)
    assert "context" not in predictions.columns
    assert json.loads(predictions.loc[0, "answer"]) == ["answer 0"]
    metrics = json.loads((folder / "metrics.json").read_text())
    # vt: seed 0 -> 0, seed 1 -> 100: mean over seeds 50
    assert metrics == {"niah_single_1": {"string_match": 100.0}, "vt": {"string_match": 50.0}}
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["press_name"] == "prob_min_h" and config["compression_ratio"] == 0.5
    assert config["seed"] == [0, 1] and config["fraction"] == 0.02 and config["model"] == "org/tiny"


def test_shard_is_stable_across_processes():
    """The split must not use Python's salted hash(): another process gives the same shards."""
    code = (
        "import json, sys\n"
        "from evaluation.store.results import shard\n"
        "items = [f'ex{i}' for i in range(50)]\n"
        "print(json.dumps(shard(items, '2/3')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == shard([f"ex{i}" for i in range(50)], "2/3")
