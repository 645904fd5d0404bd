"""``kvprob stream`` (run a streaming sweep, then write its report) and ``kvprob stream-report``.

    kvprob stream --split dev --budget 256 512 --chunk 32 --interval 32 --streams 4 --out runs/stream-dev
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from evaluation.store import manifest

SPLIT_HELP = "essay split (evaluation/tasks/prose/essays.py): dev = development, test = the held-out split"


def add_parsers(add, positive_int) -> None:
    """Register both commands with the main parser's ``add(name, help)``."""
    from evaluation.tasks.streaming.presses import stream_presses

    names = list(stream_presses())
    s = add("stream", "the streaming benchmark: eviction while decoding, NLL and KL against the full cache "
                      "(resumable: rerun the same command to finish it)")
    s.add_argument("--model", default=None, help="Hugging Face id or local folder (unset: the embedded SmolLM2-135M)")
    s.add_argument("--split", required=True, choices=["dev", "test"], help=SPLIT_HELP)
    s.add_argument("--tokens", type=positive_int("--tokens"), default=4096, help="tokens per stream")
    s.add_argument("--streams", type=positive_int("--streams"), default=None,
                   help="the first k streams of the split (unset: all)")
    s.add_argument("--budget", nargs="+", type=positive_int("--budget"), default=[256],
                   help="entries per KV head the cache is compressed back to")
    s.add_argument("--chunk", nargs="+", type=positive_int("--chunk"), default=[32],
                   help="tokens per forward (1 = true decoding); must divide --interval")
    s.add_argument("--interval", nargs="+", type=positive_int("--interval"), default=[32],
                   help="tokens between two compressions")
    s.add_argument("--presses", nargs="+", default=names, metavar="NAME",
                   help="unset: every name (evaluation/tasks/streaming/presses.py)")
    s.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the sampling presses")
    s.add_argument("--out", required=True, help="results folder (one split and stream length per folder; one file "
                                                "b<budget>-c<chunk>-i<interval>.jsonl per setting, so runs of "
                                                "different settings may share it at once)")
    r = add("stream-report", "the report (report.md) of a streaming results folder")
    r.add_argument("--results", required=True, help="results folder")


def cmd_stream(args, load, model_name) -> Path:
    from evaluation.tasks.streaming.streams import streams
    from evaluation.store.results import ResultStore
    from evaluation.tasks.streaming import report
    from evaluation.tasks.streaming.presses import stream_presses
    from evaluation.tasks.streaming.runner import head_dim, run, units

    def check(model=None):  # a setting that scores nothing, splits a chunk, or that a press refuses, stops here
        try:
            todo = units(args.presses, args.seeds, args.budget, args.chunk, args.interval)
            for u in todo:
                schedule = u.schedule(args.tokens)
                if model is not None:
                    stream_presses()[u.press](schedule, u.seed, head_dim(model), model.dtype)
        except ValueError as error:
            sys.exit(f"kvprob stream: {error}")
        return todo

    check()  # before the model loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = model_name(args.model)
    settings = dict(model=name, dataset=f"stream-{args.split}", data_seed=0, context_length=args.tokens,
                    query_aware=False, split=args.split)
    manifest.check_folder(out, manifest.identity(**settings), data_dir="")
    model, tokenizer = load(args)
    todo = check(model)
    identity = manifest.identity(**settings, loaded_model=model, tokenizer=tokenizer)
    manifest.check_folder(out, identity, data_dir="")
    selected = streams(tokenizer, args.split, args.tokens, args.streams)
    entry = manifest.run_entry(n_examples=len(selected), tasks=None, decode_batch=1, shard=None, device=str(model.device))
    entry["command"] = "kvprob " + shlex.join(args.argv)
    start, written = time.perf_counter(), 0
    for setting in dict.fromkeys((u.budget, u.chunk, u.interval) for u in todo):  # one file (one writer) each
        store = ResultStore(out / "b{}-c{}-i{}.jsonl".format(*setting))
        manifest.write(store.path, identity, entry)
        mine = [u for u in todo if (u.budget, u.chunk, u.interval) == setting]
        written += run(model, selected, mine, store, model_name=name, split=args.split)
    print(f"{written} results written to {out} in {time.perf_counter() - start:.0f} s")
    print(f"report: {report.write(out)}")
    return out


def cmd_stream_report(args) -> Path:
    from evaluation.tasks.streaming import report

    path = report.write(args.results)
    print(path.read_text())
    return path
