"""``kvprob train-gate``: Fast KVzip's gates trained on KVzip's scores of development essays (docs/presses.md).

The contexts are the first ``n`` tokens of the prose development windows (``essays.windows``, dev split only).
The essays are split by name: the last essays, in name order, until ``heldout`` contexts, are held out; the
first ``train`` contexts of the others train the gate. After training, the gate's kept set is compared on the
held-out contexts with KVzip's, both under the widest allocation (``gate_training.kept_recall``).

    kvprob train-gate                               # the embedded model: 24 training, 6 held-out contexts
    kvprob train-gate --model Qwen/Qwen3-4B         # any model (labels and training on its device)
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

CONTEXT = 1024
TRAIN, HELDOUT = 24, 6
RATIOS = (0.5, 0.75, 0.9)


def contexts(tokenizer, n: int = CONTEXT, train: int = TRAIN, heldout: int = HELDOUT
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """(training contexts, held-out contexts, held-out essays): (1, n) ids from the dev windows, split by essay."""
    from evaluation.tasks.prose.essays import windows

    found = windows(tokenizer, n, 1, "dev")
    names = sorted({w.essay for w in found})
    held: list[str] = []
    while names and sum(w.essay in held for w in found) < heldout:
        held.append(names.pop())
    fit = [w.ids[:, :n] for w in found if w.essay not in held][:train]
    out = [w.ids[:, :n] for w in found if w.essay in held][:heldout]
    if len(fit) < 1 or len(out) < 1:
        raise ValueError(f"the dev essays give {len(found)} windows of {n} tokens: too few for {train} + {heldout}")
    return fit, out, held


def training_corpus(tokenizer) -> list[torch.Tensor]:
    """The default training contexts (what ``kvprob train-gate`` trains on): a ``GatePress.corpus``."""
    return contexts(tokenizer)[0]


def add_parser(add, positive_int, model_option) -> None:
    p = add("train-gate", "train Fast KVzip's gates on KVzip's scores of dev essays (cached outside the repository), "
                          "then report the held-out kept-set recall")
    model_option(p)
    p.add_argument("--context", type=positive_int("--context"), default=CONTEXT, help="tokens per context")
    p.add_argument("--train-texts", type=positive_int("--train-texts"), default=TRAIN, help="training contexts")
    p.add_argument("--heldout-texts", type=positive_int("--heldout-texts"), default=HELDOUT,
                   help="held-out contexts (whole essays, not trained on)")
    p.add_argument("--steps", type=positive_int("--steps"), default=None, help="SGD steps (unset: TrainSettings')")
    p.add_argument("--batch-size", type=positive_int("--batch-size"), default=None, help="tokens per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the gate's initialisation and minibatches")
    p.add_argument("--out", default=None, help="JSON record of the run (unset: print only)")


def cmd_train_gate(args, load) -> dict:
    """Labels (cached), training (cached), then the held-out recall at ``RATIOS``; prints and returns the record."""
    from dataclasses import replace

    from kvpress_prob.presses import gate_training as gt

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tokenizer = load(args)
    settings = gt.TrainSettings(seed=args.seed)
    settings = replace(settings, **{k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size))
                                    if v is not None})
    fit, heldout, held_essays = contexts(tokenizer, args.context, args.train_texts, args.heldout_texts)
    path, meta = gt.fit(model, fit, settings, log_every=100)
    gates = gt.load_gates(path)
    t0 = time.perf_counter()
    recall = {}
    counts = {r: [0, 0] for r in RATIOS}
    per_text = []
    for ids in heldout:
        labels, _ = gt.kvzip_labels(model, ids)
        scores = gt.gate_scores(gates, gt.attention_inputs(model, ids))
        row = {}
        for r in RATIOS:
            both, kept = gt.kept_recall(scores, labels, r, settings.n_sink)
            counts[r][0] += both
            counts[r][1] += kept
            row[str(r)] = both / kept
        per_text.append(row)
    recall = {str(r): counts[r][0] / counts[r][1] for r in RATIOS}
    record = {"model": args.model or "embedded", "gate": str(path), "train_contexts": len(fit),
              "heldout_contexts": len(heldout), "heldout_essays": held_essays, "context": args.context,
              "recall": recall, "recall_counts": {str(r): counts[r] for r in RATIOS}, "recall_per_text": per_text,
              "heldout_seconds": time.perf_counter() - t0, "training": meta}
    print(json.dumps({k: record[k] for k in ("gate", "train_contexts", "heldout_contexts", "recall")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record
