"""Metrics against hand-worked cases."""

import pytest

from evaluation.metrics.answers import (
    TASKS,
    clean_ruler_prediction,
    normalize_answer,
    qa_f1,
    score_example,
    string_match_all,
    string_match_part,
)


# --- string matches ----------------------------------------------------------------------------


def test_string_match_all_counts_share_of_references():
    pred = "The numbers are 1234567 and 7654321."
    # 2 of 3 references are substrings -> 100 * 2 / 3
    assert string_match_all(pred, ["1234567", "7654321", "1111111"]) == pytest.approx(200 / 3)
    assert string_match_all(pred, ["1234567"]) == 100.0
    assert string_match_all(pred, ["7777777"]) == 0.0


def test_string_match_is_case_insensitive():
    assert string_match_all("answer: ABC-def", ["abc-DEF"]) == 100.0
    assert string_match_part("answer: ABC-def", ["xyz", "Abc-Def"]) == 100.0


def test_string_match_part_is_all_or_nothing():
    assert string_match_part("Paris and Lyon", ["lyon", "marseille"]) == 100.0
    assert string_match_part("Paris and Lyon", ["marseille", "nice"]) == 0.0


@pytest.mark.parametrize("fn", [string_match_all, string_match_part, qa_f1])
def test_empty_references_are_an_error(fn):
    with pytest.raises(ValueError):
        fn("anything", [])
    with pytest.raises(ValueError):
        fn("anything", "a bare string")


# --- LongBench F1 ------------------------------------------------------------------------------


def test_normalize_answer():
    assert normalize_answer("  The  Cat, sat!  ") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theater") == "theater"  # articles only as whole words


def test_qa_f1_hand_worked():
    # "the cat sat" -> "cat sat"; "a cat sat down" -> "cat sat down"
    # overlap 2; precision 2/2 = 1, recall 2/3; F1 = 2 * 1 * 2/3 / (1 + 2/3) = (4/3) / (5/3) = 0.8
    assert qa_f1("the cat sat", ["a cat sat down"]) == pytest.approx(80.0)


def test_qa_f1_uses_multiset_overlap_and_max_over_references():
    # "cat cat cat" vs "cat": overlap min(3, 1) = 1; precision 1/3, recall 1; F1 = (2/3) / (4/3) = 0.5
    assert qa_f1("cat cat cat", ["cat"]) == pytest.approx(50.0)
    # "cat cat" vs "cat cat dog": overlap 2 (a set overlap would say 1); precision 1, recall 2/3 -> 0.8
    assert qa_f1("cat cat", ["cat cat dog"]) == pytest.approx(80.0)
    # "new york city" vs "york": precision 1/3, recall 1 -> 0.5; vs "New York City." -> 1; max -> 100
    assert qa_f1("New York City", ["york"]) == pytest.approx(50.0)
    assert qa_f1("New York City", ["york", "New York City."]) == pytest.approx(100.0)
    assert qa_f1("", ["paris"]) == 0.0
    assert qa_f1("Paris.", ["paris"]) == 100.0


def test_qa_f1_first_line():
    pred = "\nParis\nThe capital of France is Lyon"
    assert qa_f1(pred, ["Paris"], first_line=True) == 100.0
    # whole text: "paris capital of france is lyon" (6 tokens, "The" dropped) vs "paris":
    # precision 1/6, recall 1 -> F1 = 2 * (1/6) / (7/6) = 2/7
    assert qa_f1(pred, ["Paris"]) == pytest.approx(200 / 7)


# --- dispatch ----------------------------------------------------------------------------------


def test_score_example_dispatch():
    refs = ["1234567", "7654321"]
    assert score_example("niah_multivalue", "1234567", refs) == 50.0  # string_match_all
    assert score_example("qa_1", "1234567", refs) == 100.0  # string_match_part
    assert score_example("qa_2", "nothing", refs) == 0.0
    assert score_example("hotpotqa", "the cat sat", ["a cat sat down"]) == pytest.approx(80.0)
    assert score_example("qasper", "\ncat\nsat", ["cat sat"]) == 100.0  # all lines count
    assert score_example("triviaqa", "\ncat\nsat", ["cat sat"]) == pytest.approx(2 * 1 * 0.5 / 1.5 * 100)


def test_ruler_predictions_are_cleaned_like_kvpress():
    # kvpress' RULER scorer removes control characters (newlines too) before matching
    assert clean_ruler_prediction(" 12\n34567\t ") == "1234567"
    assert score_example("niah_single_1", "12\n34567", ["1234567"]) == 100.0
    assert string_match_all("12\n34567", ["1234567"]) == 0.0


def test_unknown_task_lists_valid_tasks():
    with pytest.raises(ValueError, match="niah_single_1.*triviaqa"):
        score_example("narrativeqa", "x", ["x"])
    assert len(TASKS) == 16
