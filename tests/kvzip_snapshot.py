"""What every KVzip press keeps at r = 0.5, 0.75 and 0.9, as plain data, to check that a faster scoring keeps it.

Every press whose name holds ``kvzip`` (the catalogue's, the recommendations' and those named under results/;
``tests/kept_snapshot.py``'s ``names``) compresses two fixtures in float32 at r = 0.5, 0.75 and 0.9, seed 0:

- ``tiny``: the tiny random Llama of ``tests/kept_snapshot.py`` (2 layers, 2 KV heads of 2 query heads each) on
  ``N_TINY`` random tokens;
- ``embedded``: the embedded SmolLM2-135M-Instruct on the first ``N_TEXT`` tokens of a fixed English text
  (``TEXT``; its ids are stored with the snapshot).

A kept set is read as ``kept_snapshot.kept`` reads it (the compressed cache's rows matched bit for bit to a plain
prefill's keys). Ties: each press also runs on two copies of the model whose weights are scaled by 1 +- ``EPS`` x
(fixed Gaussian noise); a head whose kept set is not the same on all three is recorded as tied. ``EPS`` = 1e-4
moves a score by about 1e-4 of its size, a thousand times float32's rounding. Run as a script, it writes
``tests/data/kvzip-kept-<label>.json``:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python tests/kvzip_snapshot.py facf533
"""

from __future__ import annotations

import json
import sys

import torch

from tests import kept_snapshot as ks

RATIOS = (0.5, 0.75, 0.9)
N_TINY = 160
N_TEXT = 192
EPS = 1e-4
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a rag. "
    "For thirty years he had trimmed the wick, polished the great lens, and logged the passing ships in a "
    "leather book whose pages had gone soft with damp. In the winter of the great storm the supply boat did "
    "not come for six weeks. He rationed the flour, burned the broken chairs, and kept the light turning. "
    "When the boat finally rounded the point, the crew found him asleep at the desk, the log open to a page "
    "on which he had written, in a careful hand, the names of every vessel that had passed, the hour, and "
    "the weather. The harbour master later said that three of those ships would have struck the reef without "
    "the light. The keeper retired the next spring to a cottage above the village, where he grew beans and "
    "wrote letters to the newspaper about the price of lamp oil and the decline of good seamanship."
)


def kvzip_names() -> list[str]:
    return [n for n in ks.names() if "kvzip" in n]


def embedded(scale: float = 0.0):
    """The embedded model in float32, its weights scaled by 1 + scale x (fixed noise) when ``scale`` is not 0."""
    from kvpress_prob.models import load_model

    model, tokenizer = load_model(device="cpu", dtype=torch.float32)
    if scale:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, tokenizer


def fixtures():
    """{fixture: ([model, model x (1 + EPS noise), model x (1 - EPS noise)], ids (1, n))}."""
    ks._tokenizer_once()
    from tests.conftest import random_ids

    model, tokenizer = embedded()
    text_ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :N_TEXT]
    return {"tiny": ([ks.tiny("sdpa", s) for s in (0.0, EPS, -EPS)], random_ids(N_TINY, seed=0)),
            "embedded": ([model, embedded(EPS)[0], embedded(-EPS)[0]], text_ids)}


def snapshot(log=print) -> dict:
    torch.set_num_threads(1)
    out: dict = {"eps": EPS, "ratios": list(RATIOS), "fixtures": {}}
    for fixture, (models, ids) in fixtures().items():
        entries: dict = {}
        for name in kvzip_names():
            entry = {}
            for r in RATIOS:
                runs = [ks.kept(m, ks.build(name, r), ids) for m in models]
                base, unmatched = runs[0]
                same = torch.stack([(m == base).all(-1) for m, _ in runs[1:]]).all(0)  # (L, H)
                entry[str(r)] = {"shape": list(base.shape), "bits": ks.bits(base), "unmatched": unmatched,
                                 "tied": [[int(l), int(h)] for l, h in (~same).nonzero().tolist()]}
            entries[name] = entry
            log(fixture, name)
        out["fixtures"][fixture] = {"ids": ids[0].tolist(), "presses": entries}
    return out


if __name__ == "__main__":
    label = sys.argv[1]
    path = ks.DATA / f"kvzip-kept-{label}.json"
    data = snapshot()
    path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"{path}: {sum(len(f['presses']) for f in data['fixtures'].values())} entries")
