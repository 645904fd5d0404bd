"""The README's quickstart, run as written: its first ```python block, on the embedded model."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    if match is None:
        raise AssertionError("README.md has no ```python block")
    return match.group(1)


def embedded_model_missing() -> str | None:
    from evaluation.store.assets import MissingAssetError, require_embedded_model

    try:
        require_embedded_model()
    except MissingAssetError as error:
        return str(error)
    return None


def test_the_block_is_found_and_self_contained():
    code = first_python_block(README.read_text(encoding="utf-8"))
    compile(code, "README.md", "exec")
    for name in ("context", "question", "press", "cache"):  # defined before use, not left to the reader
        assert re.search(rf"^{name}\b.*=", code, flags=re.MULTILINE), name
    assert "get_press(RECOMMENDED" in code  # the quickstart shows the default press, by its constant


@pytest.mark.slow  # the README's quickstart on the embedded model: `make test-all`
@pytest.mark.skipif(embedded_model_missing() is not None, reason=f"{embedded_model_missing()}")
def test_quickstart_runs_as_written(capsys):
    import torch

    code = first_python_block(README.read_text(encoding="utf-8"))
    namespace: dict = {"__name__": "readme_quickstart"}
    with torch.no_grad():
        exec(compile(code, "README.md (quickstart)", "exec"), namespace)
    tokenizer, press = namespace["tokenizer"], namespace["press"]
    assert len(tokenizer(namespace["context"])["input_ids"]) < 1200  # a short context keeps this test fast
    assert isinstance(namespace["answer"], str) and namespace["answer"].strip()
    from kvpress_prob import RECOMMENDED, get_press

    assert type(press) is type(get_press(RECOMMENDED, 0.5))
    # the press really compressed: at r = 0.5 a KV head keeps half of the prompt on average (the context plus the
    # chat template's few tokens), whatever it allocates per layer and head
    context_tokens = len(tokenizer(namespace["context"]).input_ids)
    assert 0.45 < namespace["kept"] / context_tokens < 0.6
    printed = capsys.readouterr().out
    assert namespace["answer"].strip() in printed
