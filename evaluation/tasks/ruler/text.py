"""What RULER's generators share (``niah`` builds the NIAH tasks, ``words`` vt / cwe / fwe, ``hub`` the hub
tasks, ``offline`` the frames): task names, RULER's templates, kvpress's split of a
prompt into context / question / answer prefix, the word lists and line insertion."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

from evaluation.metrics.answers import RULER_TASKS
from evaluation.store.assets import package_dir

OFFLINE_TASKS = tuple(task for task in RULER_TASKS if not task.startswith("qa_"))
HUB_TASKS = ("qa_1", "qa_2")
ALL_TASKS = OFFLINE_TASKS + HUB_TASKS


HUB_REPO = "simonjegou/ruler"


# --- RULER's templates (constants.py); the generated prompt is template + answer prefix -----------
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
    " Answer: The top 10 words that appear most often in the list are:"
)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
    "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
    " Answer:"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT = "Document {i}:\n{document}"
# kvpress' split of a RULER prompt (create_huggingface_dataset.py): the context ends at the last
# question match, the answer prefix starts at the first answer match after it.
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}


@dataclass
class Example:
    """One generated example before it becomes a frame row."""

    context: str
    question: str
    answer_prefix: str
    answer: list[str]



@lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """Sorted lower-case single words of wonderwords' ``{kind}list.txt`` (kind: adjective, noun, verb)."""
    path = package_dir("wonderwords", "RULER's word lists") / "assets" / f"{kind}list.txt"
    words = {w.strip() for w in path.read_text(encoding="utf-8").splitlines()}
    return tuple(sorted(w for w in words if re.fullmatch(r"[a-z]+(?:-[a-z]+)*", w)))


def _insert_at_random_lines(rng: random.Random, lines: list[str], items: list[str]) -> list[str]:
    """Insert ``items`` in order at random line positions (positions drawn with replacement)."""
    lines = list(lines)
    positions = sorted(rng.randint(0, len(lines)) for _ in items)
    for offset, (pos, item) in enumerate(zip(positions, items)):
        lines.insert(pos + offset, item)
    return lines


def split_prompt(family: str, text: str) -> tuple[str, str, str]:
    """(context, question, answer_prefix) of a full RULER prompt, split as kvpress split its set."""
    context_end = list(QUESTION_PATTERNS[family].finditer(text))[-1].start()
    rest = text[context_end:]
    answer_start = ANSWER_PATTERNS[family].search(rest).start()
    return text[:context_end], rest[:answer_start], rest[answer_start:]
