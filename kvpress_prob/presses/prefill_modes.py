"""How a SamplingPress's prefill holds the cache until its eviction.

A layer's draw needs the proposals of the budget's scope:

- ``budget="layer"`` / ``"head"``: its own proposal only, so each layer is drawn and cut at its own
  hook, as kvpress's presses cut it. Layer l draws from its own generator, seeded from
  (seed, l) (``layer_generator``), so its draw does not depend on the order of the layers, and
  ``SamplingPress.evict`` given every layer at once (the engine's replay) draws the same;
- ``budget="global"``: every layer's proposal, so the cut waits for the last layer. ``PREFILL_MODES``
  say what is held meanwhile: ``"deferred"`` keeps every layer's full keys and values on the device;
  ``"recompute"`` runs a first forward that only computes the proposals (each layer's full keys and
  values freed right after its hook), solves the budget and draws over all of them as ``"deferred"``
  does (the same generator: the same kept sets), then the real forward cuts each layer at its hook;
  ``"offload"`` moves each layer's full keys and values to host memory after its hook (pinned and
  non-blocking on CUDA) and brings back only the kept entries.

This module holds the draw (``draw``, the one place a SamplingPress calls its sampler), the global
draw shared by the per-layer cuts of ``"recompute"`` (``global_draw``), the merge of per-layer
outcomes (``merge_draws``, ``merge_stats``), the proposals-only forward (``proposals_pass``) and the
host copies of ``"offload"`` (``to_host``, ``bring_back``).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from kvpress_prob.correction import bias as correction
from kvpress_prob.samplers import Draw, Sampler

PREFILL_MODES = ("recompute", "deferred", "offload", "auto")
#: "auto" defers on a CPU while the full K+V takes at most this share of the available host memory
DEFERRED_SHARE = 0.5

#: while ``"recompute"``'s real forward cuts its layers: (every layer's proposal, the memo of draws)
_GLOBAL: ContextVar[tuple[dict, dict] | None] = ContextVar("kvpress_prob_global_draw", default=None)


def check_mode(prefill: str) -> None:
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")


def host_available() -> int:
    """Bytes of host memory available now (``MemAvailable``; the physical total where that is unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve(prefill: str, device, kv_bytes: int) -> str:
    """The mode a prefill of full K+V ``kv_bytes`` on ``device`` runs: ``prefill`` itself, or for
    "auto" (the default; chosen by measurement): "offload" on CUDA (one
    forward, the full K+V waiting in pinned host memory), "deferred" on a CPU when the full K+V takes
    at most ``DEFERRED_SHARE`` of the available host memory, else "recompute" (one layer's full K+V
    at a time, a second forward)."""
    if prefill != "auto":
        return prefill
    device = torch.device(device)
    if device.type == "cuda":
        return "offload"
    if device.type == "cpu" and kv_bytes <= DEFERRED_SHARE * host_available():
        return "deferred"
    return "recompute"


def layer_seed(seed: int, layer_idx: int) -> int:
    """A 63-bit seed for layer ``layer_idx`` of a press seeded ``seed`` (numpy's ``SeedSequence``:
    distinct pairs give unrelated streams)."""
    return int(np.random.SeedSequence([int(seed) % 2**64, int(layer_idx)]).generate_state(1, np.uint64)[0] >> 1)


def layer_generator(sampler: Sampler, seed: int, layer_idx: int, device) -> torch.Generator:
    """The generator of one layer's draw under a per-layer or per-head budget. A coordinated design
    (one uniform per position shared by every layer and head) gets the press's own seed at every
    layer: the layers then share their uniforms, as when all are drawn at once."""
    shared = bool(getattr(sampler, "coordinated", False))
    return torch.Generator(device=device).manual_seed(int(seed) if shared else layer_seed(seed, layer_idx))


def draw(sampler: Sampler, modules: list[nn.Module], pi: torch.Tensor, compression_ratio: float, scope: str,
         seed: int) -> Draw:
    """The draw of ``modules`` (in layer order) from their proposals pi (L, b, H, n) float64.

    ``"layer"`` / ``"head"``: each layer on its own (1, b, H, n) with ``layer_generator``, stacked;
    ``"global"``: one draw over the L layers from a generator seeded ``seed``, or, inside
    ``global_draw``, the rows of these modules in the draw over every layer held there."""
    if scope != "global":
        draws = [sampler(pi[i : i + 1], compression_ratio, scope,
                         layer_generator(sampler, seed, module.layer_idx, pi.device))
                 for i, module in enumerate(modules)]
        return merge_draws(draws)
    held = _GLOBAL.get()
    if held is None:
        return sampler(pi, compression_ratio, scope, torch.Generator(device=pi.device).manual_seed(seed))
    proposals, memo = held
    order = sorted(proposals, key=lambda module: module.layer_idx)
    if any(module not in proposals for module in modules):
        raise RuntimeError("a global draw was asked for layers whose proposals the first forward did not compute")
    key = (id(sampler), float(compression_ratio), seed)  # a SummarySamplingPress draws at its own ratio
    if key not in memo:
        device = proposals[order[0]].device
        every = torch.stack([proposals[module].to(device) for module in order]).double()  # (L, b, H, n)
        memo[key] = sampler(every, compression_ratio, scope, torch.Generator(device=device).manual_seed(seed))
    full = memo[key]
    rows = torch.tensor([order.index(module) for module in modules], device=full.keep.device)
    return Draw(keep=full.keep[rows], log_weight=full.log_weight[rows], stats=full.stats)


@contextmanager
def global_draw(proposals: dict[nn.Module, torch.Tensor], memo: dict):
    """Inside the block, a global draw for some of ``proposals``' modules is their rows of the draw
    over all of them (computed once, kept in ``memo``)."""
    token = _GLOBAL.set((proposals, memo))
    try:
        yield
    finally:
        _GLOBAL.reset(token)


def merge_draws(draws: list[Draw]) -> Draw:
    """Per-layer draws (1, b, H, n) -> one Draw (L, b, H, n), their stats merged (``merge_stats``)."""
    if len(draws) == 1:
        return draws[0]
    return Draw(keep=torch.cat([d.keep for d in draws]), log_weight=torch.cat([d.log_weight for d in draws]),
                stats=merge_stats([d.stats for d in draws]))


_SUMMED = ("bytes_full", "bytes_kept", "bytes_stored", "bytes_bias", "expected_kept")
_MEAN = ("realised_ratio",)  # every layer has the same heads and prefix: the model's ratio is their mean


def merge_stats(parts: list[dict]) -> dict:
    """Stats of single layers -> the stats of all of them: byte counts summed, the realised ratio
    averaged, per-layer lists (``kept``, ``stored``, ``kept_per_head``...) concatenated, a value every
    layer shares kept once, any other value listed per layer; ``padding`` recomputed from the bytes."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if key in _SUMMED:
            out[key] = sum(values)
        elif key in _MEAN:
            out[key] = sum(values) / len(values)
        elif all(isinstance(v, list) for v in values):
            out[key] = [item for v in values for item in v]
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        else:
            out[key] = values
    if "kept" in out and "n" in out and "virtual" not in out:  # exactly as ``SamplingPress.evict`` computes it
        out["realised_ratio"] = 1.0 - sum(map(sum, out["kept"])) / (len(out["kept"]) * len(out["kept"][0]) * out["n"])
    if "padding" in out and "bytes_kept" in out:
        out["padding"] = out["bytes_stored"] / max(1, out["bytes_kept"])
    return out


@torch.no_grad()
def proposals_pass(decoder: nn.Module, args: tuple, kwargs: dict, collected: dict) -> dict:
    """Run ``decoder`` (the model's decoder stack) on the prefill's own inputs, with a new cache: the
    press's hooks, seeing ``collected`` set, store each layer's proposal in it and empty that layer's
    cache (``empty_layer``), so one layer's full keys and values live at a time. Returns ``collected``."""
    kwargs = dict(kwargs)
    kwargs["past_key_values"] = DynamicCache(config=decoder.config)
    kwargs["use_cache"] = True
    decoder(*args, **kwargs)
    return collected


def empty_layer(cache, layer_idx: int) -> None:
    """Free layer ``layer_idx``'s keys and values (new empty tensors: a slice would keep the storage)."""
    layer = cache.layers[layer_idx]
    layer.keys = layer.keys.new_empty((*layer.keys.shape[:2], 0, layer.keys.shape[3]))
    layer.values = layer.values.new_empty((*layer.values.shape[:2], 0, layer.values.shape[3]))


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``: pinned and non-blocking from CUDA; a CPU tensor is already there."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    return host.copy_(tensor, non_blocking=True)


def wait_for_host(devices) -> None:
    """Wait for the non-blocking copies to host from these devices."""
    for device in {torch.device(d) for d in devices}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def bring_back(cache, modules: list[nn.Module], devices: dict[nn.Module, torch.device]) -> None:
    """Move each cut layer (its kept keys and values, and its correction bias) back to its device."""
    for module in modules:
        device = devices[module]
        layer = cache.layers[module.layer_idx]
        if layer.keys.device == device:
            continue
        layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
        bias = correction.bias_of(module, cache)
        if bias is not None:
            correction.set_bias(module, bias.to(device), cache)
