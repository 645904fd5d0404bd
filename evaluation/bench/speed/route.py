"""Which attention function a forward runs, layer by layer, seen by a spy (nothing hard-coded).

``routes(model, forward)`` runs ``forward()`` with three spies in place and returns, per attention call,
what computed it:

- the function registered as the model's attention implementation (``ALL_ATTENTION_FUNCTIONS[impl]``),
  entered by every layer, named by ``impl`` ("sdpa", "flash_attention_2", ...): the model's own kernel;
- ``kvpress_prob.correction.corrected_attention.corrected_sdpa``: "corrected sdpa" (a dense float mask holding the bias);
- ``kvpress_prob.correction.corrected_flex.flex_corrected``: "flex" (FlexAttention, the bias in a ``score_mod``;
  compiled on CUDA, eager on a CPU);
- ``kvpress_prob.cache.ragged_attention.ragged_sdpa``: "ragged sdpa" (a ragged cache's portable route: one SDPA per KV
  head); ``kvpress_prob.cache.ragged_fused``'s ``flex_ragged``, ``nested_ragged``, ``flash_ragged``: "ragged flex",
  "ragged nested", "ragged flash" (its fused routes: one call per layer).

A layer whose module carries kvpress's ``masked_key_indices`` (AdaKV, KVzip's masks) is named
"<impl> + kvpress masks": the model's own function on a cache whose masked keys kvpress replaces by fake
keys at every step. ``route(model, forward)`` is the summary: the distinct names, in order of first use.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob.cache import ragged_attention, ragged_fused
from kvpress_prob.correction import corrected_attention, corrected_flex


@contextmanager
def _spies(implementation: str, ran: list[str]):
    inside: list[str] = []  # the route of the attention call now running (innermost last)

    def spy(name, func):
        @functools.wraps(func)
        def run(*args, **kwargs):
            if inside:
                inside[-1] = name
            else:  # called by a wrapper around the registered function, outside it
                ran.append(name)
            return func(*args, **kwargs)
        return run

    registered = ALL_ATTENTION_FUNCTIONS[implementation]

    @functools.wraps(registered)  # keeps attention_dispatch's mark: the spy is not wrapped again
    def own(module, *args, **kwargs):
        masked = getattr(module, "masked_key_indices", None) is not None
        inside.append(f"{implementation} + kvpress masks" if masked else implementation)
        try:
            return registered(module, *args, **kwargs)
        finally:
            ran.append(inside.pop())

    spied = [(corrected_attention, "corrected_sdpa", "corrected sdpa"), (corrected_flex, "flex_corrected", "flex"),
             (ragged_attention, "ragged_sdpa", "ragged sdpa"), (ragged_fused, "flex_ragged", "ragged flex"),
             (ragged_fused, "nested_ragged", "ragged nested"), (ragged_fused, "flash_ragged", "ragged flash")]
    originals = [getattr(module, attr) for module, attr, _ in spied]
    for (module, attr, name), func in zip(spied, originals):
        setattr(module, attr, spy(name, func))
    ALL_ATTENTION_FUNCTIONS[implementation] = own
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = registered
        for (module, attr, _), func in zip(spied, originals):
            setattr(module, attr, func)


def routes(model, forward) -> list[str]:
    """One name per attention call of ``forward()`` (see the module), in call order."""
    ran: list[str] = []
    with _spies(model.config._attn_implementation, ran):
        forward()
    return ran


def route(model, forward) -> str:
    """The distinct names of ``routes(model, forward)`` in order of first use, joined by " / "."""
    return " / ".join(dict.fromkeys(routes(model, forward)))
