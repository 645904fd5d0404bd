"""What a press needs from a shared full-cache prefill (``PrefillPlan``), declared by the press itself.

A prefill engine that prefills a context once and replays many presses on it (``evaluation.engine.Prefill``)
asks each press for its plan: a press of this package carries ``prefill_plan(model, n)``, which returns one.
A press without it (kvpress's own) is planned by the engine's default from kvpress's interface
(``standard_scorer``, ``scores_plan``, ``adakv_plan``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from kvpress import BasePress, ObservedAttentionPress
from kvpress.presses.scorer_press import ScorerPress

from kvpress_prob.proposals.base import scores_read_ratio

#: The plan kinds, each replayed by the engine in its own way.
KINDS = ("full", "sampling", "scores", "adakv", "gate", "eager", "kvzip", "prefill")


@dataclass(frozen=True)
class PrefillPlan:
    """How a press is reproduced after a shared full-cache prefill.

    Parameters
    ----------
    kind : str
        One of ``KINDS``: "full" (nothing to do), "sampling" (``evict`` on the proposals stored under ``key``),
        "scores" / "adakv" (kvpress's top-k / AdaKV's mask on the scores stored under ``key``), "gate" (a gate
        press's ``compress_scores`` on its gate's scores stored under ``key``), "eager" (H2O: the scores and keys
        of an eager prefill), "kvzip" (a KVzip press on the shared cache; its tail proposal, if any, stored under
        ``key``), "prefill" (a prefill under the press itself).
    key : tuple or None
        The key of the stored tensors: it leaves out what they do not depend on (a ratio, a seed), so every press
        whose tensors are the same shares them.
    compute : callable or None
        ``compute(module, kwargs, output)``: one layer's stored (b, H_kv, n) tensor, inside an attention layer's
        forward hook of the shared prefill.
    """

    kind: str
    key: tuple | None = None
    compute: Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


def standard_scorer(press) -> bool:
    """A kvpress ScorerPress whose compression is kvpress's top-k of its ``score``."""
    return (isinstance(press, ScorerPress) and type(press).compress is ScorerPress.compress
            and type(press).forward_hook is BasePress.forward_hook)


def scores_key(scorer: ScorerPress) -> tuple:
    """The key of a scorer's stored scores: its fields without its ratio, which its scores do not
    read (``scores_read_ratio``), so every ratio of one scorer shares them; with it otherwise."""
    if scores_read_ratio(scorer):
        return ("scores", repr(scorer))
    fields = ", ".join(f"{f.name}={getattr(scorer, f.name)!r}" for f in dataclasses.fields(scorer)
                       if f.repr and f.name != "compression_ratio")
    return ("scores", f"{type(scorer).__qualname__}({fields})")


def scores_plan(scorer: ScorerPress, kind: str = "scores") -> PrefillPlan:
    """``scorer``'s scores computed in the shared prefill's hooks (its ``score`` on the layer's cache), stored
    under ``scores_key``: kvpress's top-k of them ("scores"), or AdaKV's allocation of them ("adakv")."""
    def compute(module, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        return scorer.score(module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kwargs)
    return PrefillPlan(kind, scores_key(scorer), compute)


def adakv_plan(press) -> PrefillPlan:
    """An AdaKV press (``press.press`` its scorer): AdaKV's allocation of its scorer's stored scores when the
    scorer is a standard one other than H2O's (whose scores read eager weights), else a prefill of its own."""
    inner = press.press
    if standard_scorer(inner) and not isinstance(inner, ObservedAttentionPress):
        return scores_plan(inner, "adakv")
    return PrefillPlan("prefill")


__all__ = ["KINDS", "PrefillPlan", "adakv_plan", "scores_key", "scores_plan", "standard_scorer"]
