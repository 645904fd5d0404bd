"""The frame every loader returns (``FRAME_COLUMNS``, described in ``evaluation/tasks/__init__.py``)
and the helpers the loaders share to build it."""

from __future__ import annotations

import hashlib
from typing import Any

import pandas as pd

FRAME_COLUMNS = [
    "example_id",
    "task",
    "context",
    "question",
    "answer_prefix",
    "answer",
    "max_new_tokens",
    "context_tokens",
]


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` with ``tokenizer``, without special tokens."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short digest of a tokenizer: name_or_path, vocabulary size and the vocabulary itself."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(repr(vocab).encode()).hexdigest()
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return hashlib.sha256(f"{name}|{len(tokenizer)}|{digest}".encode()).hexdigest()[:16]


def as_str_list(value: Any) -> list[str]:
    """Reference answers as a plain ``list[str]`` (hub/parquet rows give numpy arrays or a bare string)."""
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def finalize_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Frame with exactly ``FRAME_COLUMNS`` (those present, in order), plain types and a 0..n-1 index."""
    df = df.reset_index(drop=True).copy()
    df["answer"] = df["answer"].map(as_str_list)
    df["example_id"] = df["example_id"].astype(str)
    df["max_new_tokens"] = df["max_new_tokens"].astype(int)
    if "context_tokens" in df:
        df["context_tokens"] = df["context_tokens"].astype(int)
    return df[[c for c in FRAME_COLUMNS if c in df.columns]]
