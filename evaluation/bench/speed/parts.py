"""Where a prefill's time goes: the plain prefill, KVzip's reconstruction forwards, its scoring, a proposal
computed in the prefill's hooks, and the allocation (with the eviction) after the scoring.

``Parts(model, press)`` is a context manager around one ``press_prefill``. Inside, it times every forward of the
language model (the first is the prefill; a KVzip press's later ones are its reconstruction passes) and, on this
press object only, the calls of its ``score_kvzip`` (KVzip's scoring after each layer's attention, inside the
reconstruction forwards), its ``fused_attention`` (the reconstruction's attention with KVzip's score from the
same logits, ``kvzip_fused``: output and score in one), its ``tail`` proposal (inside the prefill's forward:
pi_min-h of the toprest fill) and its ``compress_post`` (KVzip's allocation and eviction, after the passes).
Everything is put back on exit. ``seconds(total)`` then gives

- ``plain_prefill``: the first forward, less the proposal;
- ``reconstruction``: the later forwards, less the scoring and the fused attention;
- ``scoring``, ``fused_attention``, ``proposal``, ``allocation``: the timed calls;
- ``other``: the rest of ``total`` (kvpress's tokenizer and chunking, hooks).

A press scoring in its own forward hooks (snapkv, h2o) has it all in ``plain_prefill``.
"""

from __future__ import annotations

import time

from kvpress_prob.presses.sampling import language_model

PARTS = ("plain_prefill", "reconstruction", "scoring", "fused_attention", "proposal", "allocation", "other")


class _Timed:
    """Calls ``function``, adding its wall time to ``clock[part]``."""

    def __init__(self, function, clock: dict, part: str):
        self.function, self.clock, self.part = function, clock, part

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.clock[self.part] += time.perf_counter() - start

    def __getattr__(self, name):  # a wrapped proposal still answers for its fields
        return getattr(self.function, name)


class Parts:
    """Times the parts of one prefill under ``press`` on ``model`` (see the module)."""

    def __init__(self, model, press):
        self.model, self.press = model, press
        self.clock = {"scoring": 0.0, "fused_attention": 0.0, "proposal": 0.0, "allocation": 0.0}
        self.forwards: list[float] = []

    def __enter__(self):
        self._handles = []
        self._restore = {}
        if self.press is not None:
            for attribute, part in (("score_kvzip", "scoring"), ("fused_attention", "fused_attention"),
                                    ("compress_post", "allocation"), ("tail", "proposal")):
                original = getattr(self.press, attribute, None)
                if original is None:
                    continue
                self._restore[attribute] = original
                setattr(self.press, attribute, _Timed(original, self.clock, part))
        started: list[float] = []
        module = language_model(self.model)
        self._handles = [
            module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter())),
            module.register_forward_hook(lambda *_: self.forwards.append(time.perf_counter() - started.pop())),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        for attribute, original in self._restore.items():
            if attribute == "tail":
                setattr(self.press, attribute, original)
            else:
                delattr(self.press, attribute)  # the class's method again
        return False

    def seconds(self, total: float) -> dict[str, float]:
        """Seconds per part of ``PARTS`` (``total``: the prefill's timed wall time)."""
        first, later = (self.forwards[0] if self.forwards else 0.0), sum(self.forwards[1:])
        out = {"plain_prefill": first - self.clock["proposal"], "reconstruction": later - self.clock["scoring"] - self.clock["fused_attention"],
               **self.clock}
        out["other"] = total - sum(out.values())
        return {part: out[part] for part in PARTS}
