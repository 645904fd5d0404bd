"""The package's copy of a trained gate: stored in 16 bits, with the kept sets that check it.

The embedded model's default gate ships as package data (``artefacts.PACKAGE_DIR/<model_key>``). Its weights are
stored in ``PACKAGE_DTYPE`` (half the bytes of float32; read back as float32) and its metadata is the trained
gate's, plus the command that made the copy. Beside the weights it holds a check: a held-out development
context's ids (``check.ids``) and the float32 gate's kept sets of that context under the widest allocation at
``CHECK_RATIOS`` (``check.kept``, bit-packed), so a test can recompute the stored gate's kept sets and compare.
The metadata ``check`` records, per ratio, the share of the float32 gate's kept set that the stored gate keeps on
every held-out context given.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpress_prob.learned.labels import attention_inputs
from kvpress_prob.learned.training import gate_scores, widest_keep
from kvpress_prob.presses import artefacts
from kvpress_prob.presses.gate_store import SUFFIX, check_gates, gates_from_state_dicts, read_gates, state_dicts

#: The stored dtype of the package's gates.
PACKAGE_DTYPE = torch.bfloat16
#: The ratios at which the stored copy's kept sets are checked against the float32 gate's.
CHECK_RATIOS = (0.5, 0.75, 0.9)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 bits (little-endian within a byte), flattened and padded to a multiple of 8."""
    flat = mask.flatten().to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).view(-1, 8)
    return (flat << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8)


def unpack(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The bool tensor of ``shape`` that ``pack`` stored as ``bits``."""
    n = 1
    for size in shape:
        n *= size
    return ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:n].bool().view(shape)


def stored(gates: list, dtype: torch.dtype = PACKAGE_DTYPE) -> list:
    """``gates`` as the package stores them: rounded to ``dtype``, read back as float32."""
    return gates_from_state_dicts([{k.split(".", 1)[1]: v.float() for k, v in state_dicts([g], dtype).items()}
                                   for g in gates])


def kept_sets(model, gates: list, ids: torch.Tensor, n_sink: int) -> torch.Tensor:
    """(ratios, L, H, n) bool: the widest allocation's kept sets of ``gates``' scores of ``ids`` at ``CHECK_RATIOS``."""
    scores = gate_scores(gates, attention_inputs(model, ids))
    return torch.stack([widest_keep(scores, r, n_sink) for r in CHECK_RATIOS])


def agreement(reference: torch.Tensor, other: torch.Tensor) -> list[float]:
    """Per ratio, the share of the kept set ``reference`` (ratios, ...) that ``other`` keeps too."""
    return [float((r & o).sum() / r.sum()) for r, o in zip(reference, other)]


def package_gate(model, path: Path, heldout: list[torch.Tensor], command: str,
                 dtype: torch.dtype = PACKAGE_DTYPE) -> tuple[Path, dict]:
    """Write the package's copy of the gate at ``path`` (trained for ``model``) in ``dtype``, checked on the
    held-out contexts ``heldout`` (the first one is stored as the check); ``command`` made it. Returns the copy's
    path and its ``check`` record."""
    gates, meta = read_gates(path)
    check_gates(model, gates, meta, path)
    n_sink = meta["settings"]["n_sink"]
    rounded = stored(gates, dtype)
    shares = [agreement(kept_sets(model, gates, ids, n_sink), kept_sets(model, rounded, ids, n_sink))
              for ids in heldout]
    reference = kept_sets(model, gates, heldout[0], n_sink)
    check = {"ratios": list(CHECK_RATIOS), "shape": list(reference.shape), "n_sink": n_sink,
             "allocation": "widest", "contexts": len(heldout),
             "kept_share": {str(r): min(s[i] for s in shares) for i, r in enumerate(CHECK_RATIOS)}}
    target = artefacts.PACKAGE_DIR / meta["model_key"] / f"{path.name.removesuffix(SUFFIX)}{SUFFIX}"
    tensors = {**state_dicts(gates, dtype), "check.ids": heldout[0].to(torch.int32), "check.kept": pack(reference)}
    artefacts.save(target, tensors, {**meta, "dtype": str(dtype).split(".")[-1], "check": check,
                                     "package_command": command})
    return target, check


__all__ = ["CHECK_RATIOS", "PACKAGE_DTYPE", "agreement", "kept_sets", "pack", "package_gate", "stored", "unpack"]
