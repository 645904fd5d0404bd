"""Score teacher-forced (``teacher_forced``): one forward of a known continuation on a compressed
cache, for the fidelity benchmark (logits, and optionally each layer's attention output).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvpress_prob.presses.sampling import language_model


@torch.no_grad()
def teacher_forced(model, cache: DynamicCache, continuation_ids: torch.Tensor, n_context: int,
                   capture_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``continuation_ids`` (1, T) on ``cache`` (extended in place), positions from
    ``n_context`` as the pipeline decodes. Returns (logits (T, V) float32, each layer's attention
    output (L, T, hidden) float32, or None)."""
    outputs: dict[int, torch.Tensor] = {}

    def hook(module, args, output):
        outputs[module.layer_idx] = output[0][0].detach().float().clone()

    modules = [layer.self_attn for layer in language_model(model).layers]
    handles = [m.register_forward_hook(hook) for m in modules] if capture_attention else []
    t = continuation_ids.shape[1]
    position_ids = torch.arange(n_context, n_context + t, device=continuation_ids.device)[None]
    try:
        out = model(input_ids=continuation_ids, past_key_values=cache, position_ids=position_ids)
    finally:
        for handle in handles:
            handle.remove()
    attention = torch.stack([outputs[i] for i in range(len(modules))]) if capture_attention else None
    return out.logits[0].float(), attention
