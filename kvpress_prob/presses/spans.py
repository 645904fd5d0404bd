"""The span press: a ``SamplingPress`` over word-aligned units (``samplers.spans.SpanSampler``).

The press learns the token ids of its prefill without leaving state behind: ``SpanPress`` hooks
the model's input embedding inside its own ``with press(model):`` block only (the hook and the ids
are gone on exit), and an engine that replays a recorded prefill binds them with
``with press.tokens(context_ids):`` around ``evict``. The word boundaries come from the tokenizer
given to the press, or the model's own (``model.config._name_or_path``), loaded once.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvpress_prob.presses.sampling import SamplingPress

from kvpress_prob.samplers.spans import SpanSampler, pack_units, word_starts


@dataclass
class SpanPress(SamplingPress):
    """A ``SamplingPress`` whose sampler is a ``SpanSampler`` over word-aligned units (beyond the
    paper; module docstring). The token ids of the prefill are read by a pre-hook on the input
    embedding inside the press's own ``with`` block, or bound by ``tokens(context_ids)`` when an
    engine replays a recorded prefill through ``evict``; nothing of them outlives either block.

    Parameters
    ----------
    size : int, default 8
        Maximum tokens per unit (whole words packed up to it), >= 1.
    tokenizer : optional
        A Hugging Face tokenizer for the word boundaries; None loads the model's own from
        ``model.config._name_or_path`` (once, at ``post_init_from_model``).
    (and every ``SamplingPress`` parameter; ``sampler`` must be a ``SpanSampler``, ``budget`` "head")
    """

    size: int = 8
    tokenizer: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sampler, SpanSampler):
            raise TypeError(f"SpanPress needs a SpanSampler, got {type(self.sampler).__name__}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if self.budget != "head":
            raise ValueError(f"SpanPress keeps a fixed count per head: budget must be 'head', got {self.budget!r}")
        self._ids: torch.Tensor | None = None

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            source = getattr(model.config, "_name_or_path", "")
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(source)
            except (OSError, ValueError) as error:
                raise ValueError(
                    f"SpanPress needs a tokenizer for its word boundaries: none could be loaded from the model's "
                    f"name_or_path {source!r} ({type(error).__name__}); pass tokenizer=<the model's tokenizer>") from error

    def units_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Unit index (n,) of each position of ``ids`` (1, n) or (n,)."""
        flat = ids.reshape(-1).tolist()
        return pack_units(word_starts(self.tokenizer, flat), self.size)

    @contextmanager
    def tokens(self, context_ids: torch.Tensor):
        """Bind the prefill's token ids (1, n) for the ``evict`` calls inside the block."""
        self._ids = context_ids
        try:
            yield
        finally:
            self._ids = None

    @torch.no_grad()
    def evict(self, cache, proposals):
        n = next(iter(proposals.values())).shape[-1]
        if self._ids is None or self._ids.shape[-1] != n:
            got = None if self._ids is None else self._ids.shape[-1]
            raise RuntimeError(
                f"SpanPress needs the token ids of the {n}-token prefill (got {got}): run the prefill inside "
                f"`with press(model):` with input_ids, or bind them with `with press.tokens(context_ids):`")
        self.sampler.units = self.units_of(self._ids)
        try:
            return super().evict(cache, proposals)
        finally:
            self.sampler.units = None

    @contextmanager
    def __call__(self, model):
        def record(module, args, kwargs):
            ids = args[0] if args else kwargs.get("input")
            if ids is not None and ids.shape[-1] > 1:  # a prefill (decoding feeds one token at a time)
                self._ids = ids

        handle = model.get_input_embeddings().register_forward_pre_hook(record, with_kwargs=True)
        try:
            with super().__call__(model):
                yield
        finally:
            handle.remove()
            self._ids = None
