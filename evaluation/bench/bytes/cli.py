"""``python -m evaluation.bench bytes``: the bytes each press holds on the contexts of committed records.

For every records folder given, the contexts of its examples are rebuilt from its manifest, and every press
(``--presses``, default: the presses of the records) at every ratio and seed of the records is run again on
them, in each ``--dtypes`` (the model cast), and the bytes it holds on the cache are measured (keys, values and
the correction bias). One JSON-lines file per regime and dtype, ``<out>/bytes/<name>/<dataset>-<dtype>.jsonl``,
resumable, keyed like the records (model, dataset, data_dir, example_id, press, compression_ratio, seed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", nargs="+", required=True, help="records folders (one regime each)")
    p.add_argument("--name", required=True, help="the output folder under <out>/bytes/")
    p.add_argument("--presses", nargs="+", default=None, help="default: every press of the records")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="default: every ratio of the records")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16"])


def main(args: argparse.Namespace) -> int:
    import pandas as pd
    import torch
    from tqdm import tqdm

    from evaluation.bench import common
    from evaluation.bench.bytes.contexts import contexts, identity
    from evaluation.bench.bytes.measure import held
    from evaluation.engine.runner import Config
    from evaluation.store.results import ResultStore, record_key

    if args.quick:
        sys.exit("bench bytes has no --quick: it measures the records it is given")
    out = Path(args.out) / "bytes" / args.name
    folders = {Path(f): pd.concat([pd.read_json(j, lines=True) for j in sorted(Path(f).glob("*.jsonl"))])
               for f in args.results}
    unknown = sorted(set(args.presses or []) - {p for records in folders.values() for p in records["press"]})
    if unknown:
        sys.exit(f"--presses: {unknown} have no record in {', '.join(map(str, folders))}")
    model, tokenizer = common.load(args.model)
    written = 0
    for folder, records in folders.items():
        ident = identity(folder)
        records = records[records["press"] != "full"]
        if args.presses:
            records = records[records["press"].isin(args.presses)]
        if args.ratios:
            records = records[records["compression_ratio"].round(6).isin([round(r, 6) for r in args.ratios])]
        units = records[["example_id", "press", "compression_ratio", "seed"]].drop_duplicates()
        found = contexts(folder, model, tokenizer, set(units["example_id"]))
        for dtype in args.dtypes:
            model.to(getattr(torch, dtype))
            store = ResultStore(out / f"{ident['dataset']}-{dtype}.jsonl")
            base = dict(model=ident["model"], dataset=ident["dataset"], data_dir=str(ident["context_length"]))
            done = store.done_keys()
            for example, group in tqdm(list(units.groupby("example_id")), desc=f"{folder.name} {dtype}"):
                configs = [Config(press, float(r), int(s)) for press, r, s in
                           group[["press", "compression_ratio", "seed"]].itertuples(index=False)
                           if record_key(base | dict(example_id=example, press=press, compression_ratio=r,
                                                     seed=s)) not in done]
                if configs:
                    rows = held(model, found[example], configs)
                    store.append([base | dict(example_id=example, dtype=dtype, **row) for row in rows])
                    written += len(rows)
    model.to(torch.float32)
    print(f"{written} records written under {out}")
    return written
