"""The prose windows and their split (evaluation/tasks/prose/essays.py, docs/protocol.md "Prose split")."""

import hashlib
import re
from pathlib import Path

import pytest

from evaluation.tasks.prose import essays

ROOT = Path(__file__).resolve().parent.parent
# the development split as written into docs/protocol.md before any prose result was read
DEV = {"avg", "copy", "desres", "diff", "foundervisa", "gap", "mod", "rss", "siliconvalley", "vb", "vcsqueeze",
       "worked"}


def test_the_essays_are_the_wheels_49_files():
    files = essays.essay_files()
    assert len(files) == 49 and all(f.suffix == ".txt" and f.parent.name == "PaulGrahamEssays" for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)


def test_split_is_the_quarter_of_smallest_sha256_and_is_pinned():
    names = [f.name for f in essays.essay_files()]
    by_digest = sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    expected = {n.removesuffix(".txt") for n in by_digest[: len(names) // 4]}
    dev = {f.stem for f in essays.essays("dev")}
    test = {f.stem for f in essays.essays("test")}
    assert dev == expected == DEV  # the rule, and the split it gave when it was fixed
    assert not dev & test and len(dev) + len(test) == 49
    assert essays.split_of("gap.txt") == essays.split_of("gap") == "dev"
    assert essays.split_of("love.txt") == "test"


def test_protocol_names_the_development_essays():
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("## Prose split", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"`(\w+)\.txt`", section)) == DEV


def test_bad_names_and_splits_are_refused():
    with pytest.raises(ValueError, match="essay file names"):
        essays.split_of("nope.txt")
    with pytest.raises(ValueError, match="split must be one of"):
        essays.essays("train")
    with pytest.raises(ValueError, match="n \\(context tokens\\)"):
        essays.windows(None, 0, 256, "dev")
    with pytest.raises(ValueError, match="max_per_essay"):
        essays.windows(None, 16, 4, "dev", max_per_essay=0)


def test_windows_tile_each_essay_without_overlap(tokenizer):
    n, t = 1024, 256
    length = n + t + 1
    found = essays.windows(tokenizer, n, t, "dev")
    by_essay = {}
    for w in found:
        by_essay.setdefault(w.essay, []).append(w)
        assert w.ids.shape == (1, length)
    for stem, ws in by_essay.items():
        ids = essays.essay_ids(tokenizer, essays.essay_files()[0].with_name(f"{stem}.txt"))
        assert len(ws) == len(ids) // length  # every whole window, the short tail dropped
        for k, w in enumerate(ws):
            assert (w.index, w.start) == (k, k * length)  # consecutive and disjoint
            assert w.ids[0].tolist() == ids[k * length : (k + 1) * length]
    skipped = essays.skipped(tokenizer, n, t, "dev")
    assert set(skipped) | set(by_essay) == DEV and not set(skipped) & set(by_essay)
    assert "rss" in skipped  # 16 tokens: far shorter than a window, and not padded or concatenated


def test_windows_are_deterministic_and_capped(tokenizer):
    a = essays.windows(tokenizer, 256, 32, "dev", max_per_essay=2)
    b = essays.windows(tokenizer, 256, 32, "dev", max_per_essay=2)
    assert [w.window_id for w in a] == [w.window_id for w in b]
    assert all((x.ids == y.ids).all() for x, y in zip(a, b))
    counts = {}
    for w in a:
        counts[w.essay] = counts.get(w.essay, 0) + 1
    assert max(counts.values()) == 2
    assert {w.essay for w in essays.windows(tokenizer, 256, 32, "test", max_per_essay=1)}.isdisjoint(DEV)
