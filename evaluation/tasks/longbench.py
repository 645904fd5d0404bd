"""LongBench HotpotQA, QASPER and TriviaQA from the hub ("Xnhyacinth/LongBench"), split as kvpress splits them.

The prompt is LongBench's own (``config/dataset2prompt.json``); kvpress cuts it into
``context`` (everything before the question), ``question`` and ``answer_prefix`` ("Answer:"), so that
``context + question + answer_prefix`` is exactly LongBench's prompt:

- hotpotqa, qasper: context = the template up to "Question:", question = "Question: {input}" plus the
  template's newline(s), without the final "Answer:";
- triviaqa: context = the template up to the final question (``{input}``), question = ``input`` without
  its trailing "Answer:".

Two input schemas are accepted: THUDM's raw rows (input, context, answers, length, dataset, language,
all_classes, _id), to which the template is applied here, and the rows kvpress pushed to
"Xnhyacinth/LongBench" (context already templated, question, answer_prefix, answers, _id, ...), which are
already split this way. Rows whose ``context`` has ``max_context_tokens`` tokens or more are dropped
(the paper keeps contexts shorter than 3000 tokens). Output frame: ``evaluation.tasks.FRAME_COLUMNS``.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd

from evaluation.tasks.frame import FRAME_COLUMNS, count_tokens, finalize_frame

HUB_REPO = "Xnhyacinth/LongBench"
LONGBENCH_TASKS = ("hotpotqa", "qasper", "triviaqa")

# LongBench config/dataset2prompt.json, verbatim
PROMPTS = {
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using "
        "a single phrase or sentence if possible. If the question cannot be answered based on the information "
        "in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", "
        "or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question "
        "based on the above article as concisely as you can, using a single phrase or sentence if possible. If "
        "the question cannot be answered based on the information in the article, write \"unanswerable\". If "
        "the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
        "explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
}
MAX_NEW_TOKENS = {"hotpotqa": 32, "qasper": 128, "triviaqa": 32}  # LongBench dataset2maxlen.json
ANSWER_PREFIX = "Answer:"


def _template_parts(task: str) -> tuple[str, str]:
    """(context template, question template) of ``PROMPTS[task]``; the answer prefix is dropped."""
    prompt = PROMPTS[task]
    if task == "triviaqa":  # the input already ends in "Answer:"
        cut = prompt.index("{input}")
        return prompt[:cut], "{input}"
    cut = prompt.rindex("Question:")
    question = prompt[cut:]
    assert question.endswith(ANSWER_PREFIX)
    return prompt[:cut], question[: -len(ANSWER_PREFIX)]


def split_longbench_row(task: str, context: str, input_: str) -> tuple[str, str]:
    """(context, question) of one raw LongBench row; ``context + question + "Answer:"`` is its prompt."""
    context_template, question_template = _template_parts(task)
    if task == "triviaqa":
        question = input_.rstrip()
        question = question[: -len(ANSWER_PREFIX)] if question.endswith(ANSWER_PREFIX) else input_
        return context_template.format(context=context), question
    return context_template.format(context=context), question_template.format(input=input_)


def _read_hub(task: str, load_fn: Callable | None) -> pd.DataFrame:
    """The test split of ``task`` as a DataFrame (``load_fn`` is called like ``datasets.load_dataset``)."""
    if load_fn is None:
        from datasets import load_dataset as load_fn
    try:
        data = load_fn(HUB_REPO, data_dir=task, split="test")
    except Exception as err:
        raise RuntimeError(
            f"LongBench {task} needs the Hugging Face hub ({HUB_REPO}), which could not be reached "
            f"({type(err).__name__}: {err}). Offline benchmark: the RULER generator (dataset 'ruler')."
        ) from err
    return data if isinstance(data, pd.DataFrame) else data.to_pandas()


def _to_frame(task: str, raw: pd.DataFrame) -> pd.DataFrame:
    """Rows of either schema as context, question, answer_prefix, answer, example_id."""
    if "input" in raw.columns:  # THUDM's raw schema
        parts = [split_longbench_row(task, c, q) for c, q in zip(raw["context"], raw["input"])]
        contexts, questions = [p[0] for p in parts], [p[1] for p in parts]
    elif "question" in raw.columns:  # kvpress' preprocessed schema: already split
        contexts, questions = list(raw["context"]), list(raw["question"])
    else:
        raise ValueError(f"LongBench {task}: rows have neither 'input' nor 'question' (columns {list(raw.columns)})")
    return pd.DataFrame(
        {
            "example_id": raw["_id"].astype(str).to_numpy(),
            "task": task,
            "context": contexts,
            "question": questions,
            "answer_prefix": ANSWER_PREFIX,
            "answer": list(raw["answers"]),
            "max_new_tokens": MAX_NEW_TOKENS[task],
        }
    )


def load_longbench(
    task: str,
    tokenizer: Any,
    max_context_tokens: int = 3000,
    load_fn: Callable | None = None,
) -> pd.DataFrame:
    """One LongBench task, with contexts shorter than ``max_context_tokens`` tokens of ``tokenizer``.

    Parameters
    ----------
    task : {"hotpotqa", "qasper", "triviaqa"}
    tokenizer
        Counts the tokens of the ``context`` column (no special tokens, no chat template).
    max_context_tokens : int
        Rows with ``context_tokens >= max_context_tokens`` are dropped.
    load_fn : callable, optional
        Called as ``load_fn("Xnhyacinth/LongBench", data_dir=task, split="test")`` instead of
        ``datasets.load_dataset``; may return a ``datasets.Dataset`` or a DataFrame.

    Returns
    -------
    DataFrame with ``FRAME_COLUMNS`` (``example_id`` = LongBench ``_id``), in the source order.
    """
    if task not in LONGBENCH_TASKS:
        raise ValueError(f"Unknown LongBench task {task!r}; valid tasks: {', '.join(LONGBENCH_TASKS)}")
    df = _to_frame(task, _read_hub(task, load_fn))
    df["context_tokens"] = [count_tokens(tokenizer, c) for c in df["context"]]
    df = df[df["context_tokens"] < max_context_tokens]
    return finalize_frame(df)[FRAME_COLUMNS]
