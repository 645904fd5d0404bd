"""kvpress's KVzip scoring at bounded memory, with its scores kept per model and its refusals on entry.

kvpress's ``KVzipPress`` (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", 2025) scores each cached entry by the largest attention it receives while the model is
asked to repeat the context. ``BoundedKVzipPress`` is that press, scores and masking unchanged, with:

- **the score from the reconstruction's own attention** (float32 and float64 models): each reconstruction
  forward's attention computes the layer's output and KVzip's scores of the chunk from one set of logits
  (``kvzip_fused``): the queries are projected once and no second product over KVzip's subset is computed.
  ``kvzip_plus_normalization`` and half-precision models score after each layer's attention (next item);
- **bounded scoring memory**: each layer's scores are computed over blocks of the reconstruction's query rows,
  so that no dense attention tensor (the logits, the softmax: H_q x rows x keys, in the model's dtype) exceeds
  ``ATTENTION_BYTES`` nor one layer's K+V of the context. KVzip's score is a maximum over query rows and the softmax is per row, so the blocks'
  maxima are the scores of the whole pass. The cache entries that the reconstruction tokens appended are
  freed at each layer (kvpress's slice keeps their storage alive until the next pass);
- **a score cache** (``ScoreCache``, module instance ``SCORES``): the scores depend on the model and the context
  only, so every ratio and seed of one context reuses them. It is keyed by the model object (a weak
  reference: a model's scores are freed with it, and another model never reads them), then by the sha256 of
  the context ids, the model's dtype and the scoring fields; its scores sit on the CPU, at most
  ``SCORE_CACHE_BYTES`` over all models (oldest dropped first). ``clear_scores()`` empties it. Weights changed
  in place are not detected: clear it after changing a model's weights;
- **a public entry**: ``compress(model, cache, context_ids, tails=None)`` scores a context already prefilled
  into a cache and compresses that cache, as the ``with`` block's exit does after its prefill;
- **refusals before any pass**: eager attention and a batch of more than one context are refused on entry;
- **decoding inside the ``with`` block** (``model.generate``): a forward on the prefill's cache after the prefill
  first scores the context and compresses that cache (``decode_begins``: the kept set of the block's exit, which
  then does nothing), and a decoding forward without ``position_ids`` gets the context's real positions (the
  cache's length after eviction is the kept length). A forward on another cache raises ``GENERATE_ERROR``;
- kvpress's warning of the reconstruction's cost is printed once per process, not at every construction, and
  the tokenizer kvpress loads at every entry (its chat template; 49 MiB of host memory for the embedded model's)
  is loaded once per process (``tokenizer_of``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvpress import KVzipPress
from kvpress.presses import kvzip_press
from kvpress.utils import get_prerope_query_states
from transformers import AutoTokenizer
from transformers.models.llama.modeling_llama import rotate_half

from kvpress_prob import attention_dispatch
from kvpress_prob.presses import kvzip_fused
from kvpress_prob.presses.sampling import language_model

#: Largest dense attention tensor (logits or softmax, H_q x rows x keys) of one block of KVzip's scoring, in
#: bytes; a block's tensors are also at most one layer's K+V of the context (2 H_kv n d in the model's dtype),
#: so the scoring adds at most 2 / L of the full K+V. The reconstruction's query rows are cut into blocks under
#: both (at least one row per block).
ATTENTION_BYTES = 64 * 2**20
#: Most bytes of KVzip scores kept for reuse, over all models (one context's: L x H_kv x n in the model's dtype).
SCORE_CACHE_BYTES = 256 * 2**20

GENERATE_ERROR = ("a KVzip press scores the context prefilled by the first forward inside its `with` block; a later "
                  "forward decodes on that prefill's cache (model.generate does): pass the same past_key_values, or "
                  "prefill under the press and run other forwards after the block")


class _WarnOnce(logging.Filter):
    """Passes kvpress's KVzip cost warning the first time, drops it afterwards."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("KVzipPress requires multiple forward passes"):
            return True
        passed, self.seen = not self.seen, True
        return passed


logging.getLogger("kvpress.presses.kvzip_press").addFilter(_WarnOnce())


_TOKENIZERS: dict[str, object] = {}


def tokenizer_of(model):
    """The tokenizer kvpress's KVzip loads for ``model`` (``AutoTokenizer`` of its ``name_or_path``), loaded once
    per process and kept: KVzip only reads its chat template and encodes two fixed prompts."""
    return _load(model.config.name_or_path)


def _load(name: str):
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(name)
    return _TOKENIZERS[name]


class _Once:
    """Stands for ``AutoTokenizer`` in kvpress's KVzip module: ``from_pretrained`` loads once per name."""

    @staticmethod
    def from_pretrained(name, *args, **kwargs):
        return _load(name)


@contextmanager
def _tokenizer_loaded_once():
    """Within: kvpress's KVzipPress, which loads the model's tokenizer at every entry, gets ``tokenizer_of``'s."""
    original, kvzip_press.AutoTokenizer = kvzip_press.AutoTokenizer, _Once
    try:
        yield
    finally:
        kvzip_press.AutoTokenizer = original


class ScoreCache:
    """KVzip scores per model (weakly referenced) and key, on the CPU, at most ``limit`` bytes in all."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict key -> (tick, scores)
        self._tick = 0

    def bound(self) -> int:
        return SCORE_CACHE_BYTES if self.limit is None else self.limit

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for entries in list(self._models.values()) for _, s in entries.values())

    def __len__(self) -> int:
        return sum(len(entries) for entries in list(self._models.values()))

    def get(self, model, key: tuple) -> torch.Tensor | None:
        entries = self._models.get(model)
        if entries is None or key not in entries:
            return None
        self._tick += 1
        entries[key] = (self._tick, entries[key][1])
        entries.move_to_end(key)
        return entries[key][1]

    def put(self, model, key: tuple, scores: torch.Tensor) -> None:
        """Keep a CPU copy of ``scores``, dropping the oldest entries (over all models) above the bound; scores
        larger than the bound are not kept."""
        size = scores.numel() * scores.element_size()
        if size > self.bound():
            return
        self._tick += 1
        self._models.setdefault(model, OrderedDict())[key] = (self._tick, scores.detach().to("cpu", copy=True))
        while self.nbytes() > self.bound():
            oldest = min(((tick, entries, k) for entries in list(self._models.values())
                          for k, (tick, _) in entries.items()), key=lambda item: item[0])
            del oldest[1][oldest[2]]

    def stored(self, model=None) -> list[torch.Tensor]:
        """The kept scores of ``model`` (None: of every live model), oldest first."""
        pools = [self._models.get(model, {})] if model is not None else list(self._models.values())
        return [s for _, s in sorted((item for entries in pools for item in entries.values()), key=lambda i: i[0])]

    def clear(self) -> None:
        self._models = weakref.WeakKeyDictionary()


SCORES = ScoreCache()


def clear_scores() -> None:
    """Forget every kept KVzip score (they are otherwise freed with their model)."""
    SCORES.clear()


@dataclass
class BoundedKVzipPress(KVzipPress):
    """kvpress's ``KVzipPress`` (Kim et al. 2025, arXiv 2505.23416; scores and masking unchanged) at bounded
    scoring memory, its scores kept per model, with refusals on entry (see the module).

    Parameters
    ----------
    compression_ratio, layerwise, n_sink, kvzip_plus_normalization, chunk_size : kvpress ``KVzipPress``'s.

    Attributes
    ----------
    fused : bool, class attribute, True
        Score in the reconstruction forwards' own attention (``kvzip_fused``: one set of logits for the output
        and the score), for a float32 or float64 model. False, ``kvzip_plus_normalization`` or a half-precision
        model (whose own attention rounds its output in half precision, where the fused one would not): the
        model's attention, then kvpress's scoring after each layer's attention over blocks of rows
        (``score_kvzip``).
    """

    fused = True  # not a field: how the same scores are computed

    def score_key(self, model) -> tuple:
        """The score cache's key within ``model``: the context ids' sha256, the model's dtype, the scoring fields."""
        ids = self._context_ids.detach().to("cpu").numpy().tobytes()
        return (hashlib.sha256(ids).hexdigest(), str(model.dtype), self.n_sink, self.chunk_size,
                self.kvzip_plus_normalization)

    @contextmanager
    def __call__(self, model):
        """kvpress KVzip's context, refusing eager attention on entry and, at the block's first forward, a batch
        of more than one context. A later forward on the prefill's cache (``model.generate``'s first decoding
        step) first scores and compresses that cache (``decode_begins``); a forward on another cache raises
        ``GENERATE_ERROR``."""
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation == "eager":
            raise ValueError("attn_implementation 'eager' is not supported by KVzip presses (kvpress's KVzip masks "
                             "and our evictions decode through the attention interface): load the model with "
                             "attn_implementation='sdpa' or 'flash_attention_2'")
        state = {"context": None, "scoring": False, "shift": None}  # shift: context length - kept length

        def guard(module, args, kwargs):
            if state["scoring"]:  # the reconstruction passes
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            if state["context"] is None:
                if ids is not None:
                    check_batch(ids)
                state["context"] = (ids, kwargs.get("past_key_values"))
                return None
            if state["shift"] is None:
                context, cache = state["context"]
                if cache is None or kwargs.get("past_key_values") is not cache or context is None:
                    raise RuntimeError(GENERATE_ERROR)
                state["scoring"] = True
                try:
                    state["shift"] = context.shape[1] - self.decode_begins(model, cache, context)
                finally:
                    state["scoring"] = False
            if kwargs.get("position_ids") is None:  # the new tokens take the context's positions
                cache, q = kwargs["past_key_values"], (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
                start = cache.get_seq_length() + state["shift"]
                kwargs["position_ids"] = torch.arange(start, start + q, device=cache.layers[0].keys.device)[None]
            return args, kwargs

        self._scored_in_block = False
        with _tokenizer_loaded_once(), super().__call__(model):
            handle = language_model(model).register_forward_pre_hook(guard, with_kwargs=True)
            try:
                yield
            finally:
                handle.remove()
        self._scored_in_block = False

    @torch.no_grad()
    def decode_begins(self, model, cache, context_ids: torch.Tensor) -> int:
        """Score ``context_ids`` and compress ``cache`` (which holds their prefill) inside the ``with`` block, when
        a forward on that cache begins decoding: what the block's exit would do, which then does nothing.
        Returns the kept length (``cache.get_seq_length()``)."""
        if self.compression_ratio > 0:
            for layer in language_model(model).layers:
                layer.self_attn.rotary_emb = language_model(model).rotary_emb  # as kvpress's exit sets it
            self._context_ids, self._cache = context_ids, cache
            self._perform_kvzip_compression(model, tokenizer_of(model))
        self._scored_in_block = True
        return cache.get_seq_length()

    def compress(self, model, cache, context_ids: torch.Tensor, tails: dict | None = None):
        """Score the context ``context_ids`` (1, n), already prefilled into ``cache``, and compress ``cache`` in
        place, as the press does when its ``with`` block exits after that prefill (kvpress's entry and exit,
        the scores reused where kept). ``tails``: layer index -> the tail proposal of that layer's prefill, for
        a press with a ``tail`` (else computed by no one: refused). Returns ``cache``."""
        check_batch(context_ids)
        if tails is not None and getattr(self, "tail", None) is None:
            raise ValueError("tails: this press has no tail proposal")
        with self(model):
            self._context_ids, self._cache = context_ids, cache
            if tails is not None:
                self._tails.update(tails)
        return cache

    def _perform_kvzip_compression(self, model, tokenizer):
        """Reuse this context's kept scores, else run kvpress's reconstruction passes (batch checked first);
        nothing on the block's exit where decoding inside it already compressed the cache."""
        if getattr(self, "_scored_in_block", False):
            return
        check_batch(self._context_ids)
        kept = SCORES.get(model, self.score_key(model))
        if kept is not None:
            self.context_length = self._context_ids.shape[1]
            self.score_val = kept.to(self._cache.layers[0].keys.device, copy=True)
            self.compress_post(model)
            return
        if not self.fused or self.kvzip_plus_normalization or model.dtype not in (torch.float32, torch.float64):
            super()._perform_kvzip_compression(model, tokenizer)
            return
        attention_dispatch.install()  # the one wrapper, whose "kvzip_fused" handler answers within ``active``
        self._fused_layers = set()
        with kvzip_fused.active(self, [layer.self_attn for layer in language_model(model).layers]):
            super()._perform_kvzip_compression(model, tokenizer)

    def fused_attention(self, module, query, key, value, scaling: float) -> torch.Tensor:
        """The reconstruction forward's attention output for ``module``, its KVzip scores of the chunk put in
        ``score_val`` from the same logits (``kvzip_fused.fused_attention``); ``score_kvzip`` then only frees the
        reconstruction's entries."""
        output, scores = kvzip_fused.fused_attention(
            query, key, value, scaling, min(self.n_sink, self.start_idx), self.start_idx, self.end_idx,
            ATTENTION_BYTES)
        self.score_val[int(module.layer_idx)][..., self.start_idx : self.end_idx] = scores
        self._fused_layers.add(int(module.layer_idx))
        return output

    def compress_post(self, model):
        """Keep the scores for later ratios and seeds, then kvpress's masking."""
        self.remember(model)
        super().compress_post(model)

    def remember(self, model) -> None:
        """Keep this context's scores (``SCORES``) for later ratios and seeds."""
        SCORES.put(model, self.score_key(model), self.score_val)

    @torch.no_grad()
    def score_kvzip(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's ``score_kvzip`` over blocks of query rows (each dense tensor under ``ATTENTION_BYTES`` and one
        layer's K+V): the
        largest attention (softmax over the sinks, the chunk and the causal reconstruction tokens) each chunk
        entry receives from any query head of its group and any row, into ``score_val``. Returns the prefilled
        keys and values as new tensors (the reconstruction's entries freed)."""
        n = self.context_length
        if int(module.layer_idx) in getattr(self, "_fused_layers", ()):  # scored in the forward's attention
            self._fused_layers.discard(int(module.layer_idx))
            return keys[:, :, :n].clone(), values[:, :, :n].clone()
        b, q_len, _ = hidden_states.shape
        sink, ctx_len = min(self.n_sink, self.start_idx), self.end_idx - self.start_idx
        h_kv = module.config.num_key_value_heads
        groups, d = module.config.num_attention_heads // h_kv, module.head_dim
        cos, sin = kwargs["position_embeddings"]
        queries = get_prerope_query_states(module, hidden_states)  # (b, H_q, q, d)
        queries = (queries * cos.unsqueeze(1)) + (rotate_half(queries) * sin.unsqueeze(1))
        # scaled once (not the logits), each row's query group adjacent: (b, H_kv, q, G, d)
        queries = queries.mul_(1 / math.sqrt(d)).view(b, h_kv, groups, q_len, d).transpose(2, 3).contiguous()
        # the keys the rows see, contiguous once per layer: the sinks, the chunk, the reconstruction tokens
        chosen = [keys[:, :, :sink], keys[:, :, self.start_idx : self.end_idx], keys[:, :, -q_len:]]
        keys_t = torch.cat(chosen, dim=2).transpose(-2, -1)  # (b, H_kv, d, m), a view of (b, H_kv, m, d)
        m = keys_t.shape[-1]  # sink + ctx_len + q_len
        if self.kvzip_plus_normalization:
            h_norm = hidden_states.norm(dim=-1)  # (b, q)
            kept_values = torch.cat([values[:, :, :sink], values[:, :, self.start_idx : self.end_idx],
                                     values[:, :, -q_len:]], dim=2)
            wov_norm = self._compute_value_output_norm(module, kept_values)  # (b, H_kv, G, m)
        layer_kv = 2 * keys.shape[1] * self.context_length * d * keys.element_size()  # one layer's K+V, bytes
        rows = max(1, min(ATTENTION_BYTES, layer_kv) // (b * h_kv * groups * m * queries.element_size()))
        scores = None
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            # the query group folded into the rows: one (G rows, d) x (d, m) product per KV head, keys not copied
            block = queries[:, :, start:stop].view(b, h_kv, (stop - start) * groups, d)
            logits = torch.matmul(block, keys_t).view(b, h_kv, stop - start, groups, m)  # (b, H_kv, rows, G, m)
            # query row i (of q_len) sees the reconstruction tokens j <= i (the last q_len keys)
            future = torch.arange(q_len, device=logits.device)[None, None, :] > torch.arange(start, stop, device=logits.device)[:, None, None]
            logits[..., -q_len:].masked_fill_(future, torch.finfo(logits.dtype).min)
            weights = torch.softmax(logits, dim=-1)
            del logits
            if self.kvzip_plus_normalization:
                weights.mul_((1 / h_norm[:, None, start:stop, None, None]).to(weights.dtype))
                weights.mul_(wov_norm[:, :, None, :, :].to(weights.dtype))
            block = weights[..., sink : sink + ctx_len].amax(dim=(-3, -2))  # (b, H_kv, ctx_len): max over rows, group
            scores = block if scores is None else torch.maximum(scores, block)
            del weights
        self.score_val[int(module.layer_idx)][..., self.start_idx : self.end_idx] = scores
        return keys[:, :, :n].clone(), values[:, :, :n].clone()


def check_batch(ids: torch.Tensor) -> None:
    """Refuse a batch of more than one context (KVzip scores one context)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"KVzip presses score one context: input_ids must have batch size 1, got shape "
                         f"{tuple(ids.shape)}")


__all__ = ["ATTENTION_BYTES", "BoundedKVzipPress", "GENERATE_ERROR", "SCORES", "SCORE_CACHE_BYTES", "ScoreCache",
           "check_batch", "clear_scores", "tokenizer_of"]
