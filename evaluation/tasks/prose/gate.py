"""``kvprob train-gate``: Fast KVzip's gates trained on KVzip's scores of development texts (docs/presses.md).

The contexts are the first ``n`` tokens of development texts only: prose development windows (``essays.windows``,
dev split) and RULER development haystacks (``--data-seed 0``'s generator, each task's examples after the first, so
never one that the development runs read: those take each task's first). Only RULER's haystacks of noise, needles
and words: its essay haystack is the essays in name order, whose first ones are prose test essays. The essays are split by name: the last
essays, in name order, until ``heldout`` contexts, are held out; the first ``prose`` contexts of the others and
``ruler`` haystacks train the gate. The gate's file is named by the corpus and the settings
(``gate_store.gate_name``); ``--set-default`` makes it the model's default, the gate that a gate press built by
name loads. After training, the gate's kept set is compared on the held-out contexts with KVzip's, both under the
widest allocation (``learned.training.kept_recall``).

    kvprob train-gate --set-default                 # the embedded model: 20 prose + 10 RULER, 4 held-out contexts
    kvprob train-gate --package                     # the same, and its 16-bit copy into the package's files
    kvprob train-gate --model Qwen/Qwen3-4B         # any model (labels and training on its device)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

CONTEXT = 1024
PROSE, RULER, HELDOUT = 20, 10, 4
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "fwe")  # the development runs', not on essays
RATIOS = (0.5, 0.75, 0.9)


def corpus_name(n: int, prose: int, ruler: int) -> str:
    """The name of the corpus ``contexts`` gives (``gate_store.DEFAULT_CORPUS`` for the defaults)."""
    return f"dev-prose{prose}-ruler{ruler}-{n}"


def ruler_haystacks(tokenizer, n: int, count: int) -> list[torch.Tensor]:
    """``count`` development RULER contexts of at most ``n`` tokens, (1, n') ids: each task's examples from its second
    on (the development runs read each task's first), task by task in turn."""
    from evaluation.tasks import load_dataset_frame

    if count == 0:
        return []
    per_task = -(-count // len(RULER_TASKS)) + 1
    frame = load_dataset_frame("ruler", tokenizer, context_length=n, n_examples=per_task * len(RULER_TASKS), seed=0,
                               tasks=list(RULER_TASKS))
    later = frame[~frame["example_id"].str.endswith("-0")]
    order = sorted(later.itertuples(), key=lambda r: (int(r.example_id.rsplit("-", 1)[1]), RULER_TASKS.index(r.task)))
    return [tokenizer(r.context, return_tensors="pt", add_special_tokens=False).input_ids[:, :n]
            for r in order[:count]]


def contexts(tokenizer, n: int = CONTEXT, prose: int = PROSE, ruler: int = RULER, heldout: int = HELDOUT
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """(training contexts, held-out contexts, held-out essays): (1, n) ids of dev windows, split by essay, and
    ``ruler`` development haystacks (training only)."""
    from evaluation.tasks.prose.essays import windows

    found = windows(tokenizer, n, 1, "dev")
    names = sorted({w.essay for w in found})
    held: list[str] = []
    while names and sum(w.essay in held for w in found) < heldout:
        held.append(names.pop())
    fit = [w.ids[:, :n] for w in found if w.essay not in held][:prose]
    out = [w.ids[:, :n] for w in found if w.essay in held][:heldout]
    if len(fit) < prose or len(out) < 1:
        raise ValueError(f"the dev essays give {len(found)} windows of {n} tokens: too few for {prose} + {heldout}")
    return fit + ruler_haystacks(tokenizer, n, ruler), out, held


def add_parser(add, positive_int, model_option) -> None:
    p = add("train-gate", "train Fast KVzip's gates on KVzip's scores of dev texts (cached outside the repository), "
                          "then report the held-out kept-set recall")
    model_option(p)
    p.add_argument("--context", type=positive_int("--context"), default=CONTEXT, help="tokens per context")
    p.add_argument("--prose-texts", type=positive_int("--prose-texts"), default=PROSE, help="prose training contexts")
    p.add_argument("--ruler-texts", type=int, default=RULER, help="RULER training haystacks")
    p.add_argument("--heldout-texts", type=positive_int("--heldout-texts"), default=HELDOUT,
                   help="held-out prose contexts (whole essays, not trained on)")
    p.add_argument("--steps", type=positive_int("--steps"), default=None, help="SGD steps (unset: TrainSettings')")
    p.add_argument("--batch-size", type=positive_int("--batch-size"), default=None, help="tokens per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the gate's initialisation and minibatches")
    p.add_argument("--set-default", action="store_true",
                   help="make this gate the model's default: what a gate press built by name loads")
    p.add_argument("--package", action="store_true",
                   help="write the gate's 16-bit copy into the package's files (kvpress_prob/learned/artefacts/), "
                        "checked on the held-out contexts: what ships for the embedded model")
    p.add_argument("--out", default=None, help="JSON record of the run (unset: print only)")


def command(args) -> str:
    """The command that trains the gate ``args`` name: every setting spelled out."""
    words = ["python -m evaluation train-gate"] + ([f"--model {args.model}"] if args.model else []) + [
        f"--context {args.context}", f"--prose-texts {args.prose_texts}", f"--ruler-texts {args.ruler_texts}",
        f"--heldout-texts {args.heldout_texts}", f"--seed {args.seed}"]
    words += [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("steps", "batch_size") if getattr(args, k)]
    return " ".join(words)


def cmd_train_gate(args, load) -> dict:
    """Labels (cached), training (cached), the default if asked, the per-head budget profile on the same contexts'
    labels (``learned.profile.learn_profile``), then the held-out recall at ``RATIOS``; prints and returns the
    record."""
    from dataclasses import replace

    from kvpress_prob.learned import labels as lb
    from kvpress_prob.learned import training as tr
    from kvpress_prob.learned.profile import learn_profile
    from kvpress_prob.presses import gate_store as gs

    if args.ruler_texts < 0:
        raise ValueError(f"--ruler-texts must be >= 0, got {args.ruler_texts}")
    model, tokenizer = load(args)
    settings = gs.TrainSettings(seed=args.seed)
    settings = replace(settings, **{k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size))
                                    if v is not None})
    corpus = corpus_name(args.context, args.prose_texts, args.ruler_texts)
    fit, heldout, held_essays = contexts(tokenizer, args.context, args.prose_texts, args.ruler_texts,
                                         args.heldout_texts)
    path, meta = tr.fit(model, fit, corpus, settings, command=command(args))
    if args.set_default:
        gs.set_default(model, path.stem)
    if args.package:
        from kvpress_prob.learned.package import package_gate

        packaged, check = package_gate(model, path, heldout, f"{command(args)} --package")
        print(f"package copy: {packaged} (kept share of the float32 gate's: {check['kept_share']})")
    profile = learn_profile(model, fit, command(args) + " --package" * args.package, package=args.package)
    print(f"budget profile: {profile}")
    gates = gs.load_gates(path)
    t0 = time.perf_counter()
    counts = {r: [0, 0] for r in RATIOS}
    per_text = []
    for ids in heldout:
        labels, _ = lb.kvzip_labels(model, ids)
        scores = tr.gate_scores(gates, lb.attention_inputs(model, ids))
        row = {}
        for r in RATIOS:
            both, kept = tr.kept_recall(scores, labels, r, settings.n_sink)
            counts[r][0] += both
            counts[r][1] += kept
            row[str(r)] = both / kept
        per_text.append(row)
    recall = {str(r): counts[r][0] / counts[r][1] for r in RATIOS}
    record = {"model": args.model or "embedded", "gate": path.stem, "default": gs.default_gate(model) == path.stem,
              "profile": str(profile),
              "prose_contexts": args.prose_texts, "ruler_contexts": len(fit) - args.prose_texts,
              "heldout_contexts": len(heldout), "heldout_essays": held_essays, "context": args.context,
              "recall": recall, "recall_counts": {str(r): counts[r] for r in RATIOS}, "recall_per_text": per_text,
              "heldout_seconds": time.perf_counter() - t0,
              "training": {k: v for k, v in meta.items() if k != "context_digests"}}
    print(json.dumps({k: record[k] for k in ("gate", "default", "heldout_contexts", "recall")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record
