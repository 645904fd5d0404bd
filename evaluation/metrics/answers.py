"""Per-example metrics of RULER (kvpress' ruler scorer) and LongBench (LongBench's qa_f1_score), x100.

Pure functions of (prediction, references). A task's score is the mean of its examples' scores.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
LONGBENCH_TASKS = ("hotpotqa", "qasper", "triviaqa")
TASKS = RULER_TASKS + LONGBENCH_TASKS

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")
_PUNCTUATION = set(string.punctuation)


def _check_references(references: Sequence[str]) -> None:
    if isinstance(references, str) or len(references) == 0:
        raise ValueError(f"references must be a non-empty list of strings, got {references!r}")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of ``references`` found (case-insensitive substring) in ``prediction``, x100."""
    _check_references(references)
    pred = prediction.lower()
    return 100.0 * sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """100 if any of ``references`` is found (case-insensitive substring) in ``prediction``, else 0."""
    _check_references(references)
    pred = prediction.lower()
    return 100.0 if any(r.lower() in pred for r in references) else 0.0


def clean_ruler_prediction(prediction: str) -> str:
    """kvpress/RULER post-processing: strip, drop control characters (newlines included), strip."""
    return _CONTROL_CHARS.sub("", prediction.strip()).strip()


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, drop punctuation, drop a/an/the, collapse white space."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 in [0, 1] of the multiset overlap of two token lists (0 when they share nothing)."""
    same = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, references: Sequence[str], first_line: bool = False) -> float:
    """LongBench's qa_f1_score, max over ``references``, x100.

    ``first_line=True`` scores only the prediction's first line (after leading newlines), as LongBench
    does for TriviaQA.
    """
    _check_references(references)
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    pred_tokens = normalize_answer(prediction).split()
    return 100.0 * max(token_f1(pred_tokens, normalize_answer(r).split()) for r in references)


def score_example(task: str, prediction: str, references: Sequence[str]) -> float:
    """Score in [0, 100] of one prediction for ``task``.

    RULER: the prediction is cleaned like kvpress' scorer (``clean_ruler_prediction``), then
    qa_1/qa_2 use ``string_match_part`` and every other task ``string_match_all``. LongBench:
    hotpotqa/qasper use ``qa_f1``, triviaqa ``qa_f1(first_line=True)``.
    """
    if task in ("qa_1", "qa_2"):
        return string_match_part(clean_ruler_prediction(prediction), references)
    if task in RULER_TASKS:
        return string_match_all(clean_ruler_prediction(prediction), references)
    if task in ("hotpotqa", "qasper"):
        return qa_f1(prediction, references)
    if task == "triviaqa":
        return qa_f1(prediction, references, first_line=True)
    raise ValueError(f"Unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
