"""``python -m evaluation.bench bytes``: the bytes each press holds on the contexts of committed records.

The records folders given hold one regime's examples (their manifests agree on the data; a folder without a
manifest takes the first one's). The contexts are rebuilt from a manifest, and every press (``--presses``,
default: the presses of the records) at every ratio and seed of the records is run again on them, one shared
prefill per context, in each ``--dtypes`` (the model cast), and the bytes it holds on the cache are measured (keys, values and
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
    p.add_argument("--max-examples", type=int, default=None,
                   help="only the first N examples (by example id) of the records: a partial measurement, counted")


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
    with_manifest = [f for f in folders if (f / "results.manifest.json").exists()]
    if not with_manifest:
        sys.exit(f"--results: none of {', '.join(map(str, folders))} has a results.manifest.json")
    source, ident = with_manifest[0], identity(with_manifest[0])
    keep = ("model_digest", "dataset", "dataset_version", "data_seed", "context_length", "split")
    for f in with_manifest[1:]:
        other = identity(f)
        if any(other.get(k) != ident.get(k) for k in keep):
            sys.exit(f"--results: {f} and {source} hold different examples ({keep} differ): one regime per call")
    records = pd.concat(folders.values())
    records = records[records["press"] != "full"]
    if args.presses:
        records = records[records["press"].isin(args.presses)]
    if args.ratios:
        records = records[records["compression_ratio"].round(6).isin([round(r, 6) for r in args.ratios])]
    units = records[["example_id", "press", "compression_ratio", "seed"]].drop_duplicates()
    if args.max_examples is not None:
        units = units[units["example_id"].isin(sorted(units["example_id"].unique())[: args.max_examples])]
    model, tokenizer = common.load(args.model)
    found = contexts(source, model, tokenizer, set(units["example_id"]))  # every folder's examples: the same ones
    written = 0
    for dtype in args.dtypes:
        model.to(getattr(torch, dtype))
        store = ResultStore(out / f"{ident['dataset']}-{dtype}.jsonl")
        base = dict(model=ident["model"], dataset=ident["dataset"], data_dir=str(ident["context_length"]))
        done = store.done_keys()
        for example, group in tqdm(list(units.groupby("example_id")), desc=f"{ident['dataset']} {dtype}"):
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
