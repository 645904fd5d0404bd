"""kvprob: generate datasets, run sweeps, merge shards, report, reproduce the paper's presets.

    kvprob generate --dataset ruler --context-length 4096
    kvprob run --dataset ruler --context-length 1024 --presses snapkv prob_min_h --ratios 0.5 --out runs/x
    kvprob merge --out runs/x/results.jsonl runs/x/shard-*.jsonl
    kvprob report --results runs/x
    kvprob reproduce --preset cpu-quick
    kvprob demo                  # cpu-quick computed afresh into results/demo, next to results/cpu-quick
    kvprob presses               # the presses by origin and family (--all: every name; NAME: one)
    kvprob recommended           # the four recommendations: quality, price, evidence (--markdown: the README table)
    kvprob prose run --split dev --context 1024 --presses snapkv prob_min_h --out runs/prose-x
    kvprob prose report --results runs/prose-x
    kvprob stream --split dev --budget 256 --out runs/stream-dev   # eviction while decoding (docs/research/README.md)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from evaluation.store import manifest
from evaluation.store.assets import require_embedded_model
from evaluation.tasks import dataset_version, load_dataset_frame
from evaluation.tasks.ruler.offline import OFFLINE_TASKS
from evaluation.arguments import (DECODE_BATCH_HELP, HelpFormatter, data_options, decode_batch, model_option,
                                  positive_int, ratio_type, wrapped)
from evaluation.presets import (DEMO_OUT, DEMO_REFERENCE, PAPER_METHODS, PRESETS, PROSE_DEMO,  # noqa: F401
                                PROSE_DEMO_REFERENCE, default_out)
from kvpress_prob.names.registry import PRESSES, factory

EMBEDDED_ALIASES = (None, "", "embedded")


def _model_name(model_arg: str | None) -> str:
    from kvpress_prob.models import EMBEDDED_NAME

    return EMBEDDED_NAME if _uses_embedded(model_arg) else model_arg


def _uses_embedded(model_arg: str | None) -> bool:
    from kvpress_prob.models import EMBEDDED_NAME

    return model_arg in EMBEDDED_ALIASES + (EMBEDDED_NAME,)


def _load(args):
    from kvpress_prob.models import load_model

    if _uses_embedded(args.model):
        require_embedded_model()
    device_map = getattr(args, "device_map", None)
    if device_map is not None and device_map.startswith("{"):
        device_map = json.loads(device_map)
    return load_model(args.model, device_map=device_map)


def _frame(args, tokenizer):
    tasks = args.tasks or None
    if tasks:
        unknown = set(tasks) - set(OFFLINE_TASKS) - {"qa_1", "qa_2", "hotpotqa", "qasper", "triviaqa"}
        if unknown:
            sys.exit(f"unknown task(s) {sorted(unknown)}; valid: {', '.join(OFFLINE_TASKS)}, qa_1, qa_2, "
                     "hotpotqa, qasper, triviaqa")
    kwargs = dict(context_length=args.context_length, seed=args.data_seed, tasks=tasks)
    if args.n_examples:
        kwargs["n_examples"] = args.n_examples
    if args.dataset == "longbench":
        kwargs = dict(tasks=tasks, max_context_tokens=args.context_length)
    return load_dataset_frame(args.dataset, tokenizer, **kwargs)


def cmd_generate(args) -> None:
    from transformers import AutoTokenizer

    from kvpress_prob.models import embedded_model_path

    if _uses_embedded(args.model):
        require_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path() if _uses_embedded(args.model) else args.model)
    df = _frame(args, tokenizer)
    print(df.groupby("task").size().to_string())
    print(f"{len(df)} examples, context tokens {df.context_tokens.min()}-{df.context_tokens.max()}")


def _data_dir(args) -> str:
    """The records' data_dir: the RULER context length (LongBench: "lt3000")."""
    return str(args.context_length) if args.dataset.startswith("ruler") else "lt3000"


def cmd_run(args, load=None) -> Path:
    """A sweep into ``args.out``; ``load(args)`` gives (model, tokenizer) (unset: ``_load``)."""
    from evaluation.engine.runner import configurations, run
    from evaluation.store.results import ResultStore

    for name in args.presses:
        try:
            factory(name)
        except ValueError as error:
            sys.exit(f"kvprob run: {error}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = configurations(args.presses, args.ratios, args.seeds)
    data_dir = _data_dir(args)
    settings = dict(model=_model_name(args.model), dataset=args.dataset, data_seed=args.data_seed,
                    context_length=args.context_length, query_aware=args.query_aware,
                    dataset_version=dataset_version(args.dataset))
    manifest.check_folder(out, manifest.identity(**settings), data_dir=data_dir)  # before the model is loaded
    model, tokenizer = (load or _load)(args)
    identity = manifest.identity(**settings, loaded_model=model, tokenizer=tokenizer)
    notes = manifest.check_folder(out, identity, data_dir=data_dir)
    for note in notes:
        print(note, file=sys.stderr)
    df = _frame(args, tokenizer)
    name = "results.jsonl" if not args.shard else f"shard-{args.shard.replace('/', 'of')}.jsonl"
    store = ResultStore(out / name)
    manifest.write(store.path, identity, manifest.run_entry(
        n_examples=args.n_examples, tasks=args.tasks, decode_batch=args.decode_batch, shard=args.shard,
        device=str(model.device)), notes)
    store.path.touch()  # a shard without examples still leaves its (empty) file for merge
    start = time.perf_counter()
    written = run(model, tokenizer, df, configs, store, model_name=_model_name(args.model), dataset=args.dataset,
                  data_dir=data_dir, query_aware=args.query_aware, shard_spec=args.shard,
                  decode_batch=args.decode_batch)
    print(f"{written} results written to {store.path} in {time.perf_counter() - start:.0f} s")
    return out


def cmd_merge(args) -> None:
    from evaluation.store.results import merge

    shards = [Path(p) for p in args.shards]
    for note in manifest.merge(shards, Path(args.out)):  # refuses missing shards and mismatched manifests
        print(note, file=sys.stderr)
    print(f"{merge(shards, Path(args.out))} records in {args.out}")


def cmd_report(args) -> dict:
    from evaluation.report.tables import write_report
    from evaluation.store.kvpress_folders import write_kvpress_folder
    from evaluation.store.results import load_results, results_files

    root = Path(args.results)
    df = load_results(*results_files(root))
    out = Path(args.out) if args.out else (root if root.is_dir() else root.parent) / "report"
    paths = write_report(df, out, args.title)
    if args.kvpress_folders:
        for (dataset, data_dir, model, press, ratio), group in df.groupby(
            ["dataset", "data_dir", "model", "press", "compression_ratio"]
        ):
            write_kvpress_folder(out / "kvpress", group, dataset, data_dir, model, press, ratio)
    print(paths["summary_markdown"])
    print(f"\nTables and plots: {out}")
    return paths


def cmd_compare(args) -> str:
    from evaluation.report.compare import markdown
    from evaluation.store.results import load_folders, write_atomic

    text = markdown(load_folders(args.results), args.split, presses=args.presses)
    if args.out:
        write_atomic(Path(args.out), text)
    print(text)
    return text


def _clear_results(out: Path) -> None:
    """Remove a results folder's records, manifests, legacy data seed and report (only those), so that a run
    computes afresh."""
    import shutil

    for path in [*out.glob("results.jsonl"), *out.glob("shard-*.jsonl"), *out.glob("*" + manifest.SUFFIX),
                 *out.glob(manifest.LEGACY_SEED_FILE)]:
        path.unlink()
    if (out / "report").is_dir():
        shutil.rmtree(out / "report")


def cmd_reproduce(args, load=None) -> None:
    preset = dict(PRESETS[args.preset])
    for field in ("context_length", "n_examples"):
        if getattr(args, field) is not None:
            preset[field] = getattr(args, field)
    out = args.out or default_out(args.preset, preset["context_length"])
    if args.fresh:
        _clear_results(Path(out))
    run_args = argparse.Namespace(
        model=args.model, dataset=preset["dataset"], context_length=preset["context_length"],
        n_examples=preset["n_examples"], tasks=preset.get("tasks"), data_seed=args.data_seed, presses=preset["presses"],
        ratios=preset["ratios"], seeds=preset["seeds"], out=out, shard=args.shard, query_aware=args.query_aware,
        decode_batch=args.decode_batch,
    )
    start = time.perf_counter()
    cmd_run(run_args, load)
    if not args.shard:
        cmd_report(argparse.Namespace(results=out, out=None, title=f"{args.preset} on {_model_name(args.model)}",
                                      kvpress_folders=True))
    wall = time.perf_counter() - start
    if args.reference and not args.shard:
        from evaluation.report.side_by_side import comparison_markdown

        print("\n" + comparison_markdown(out, args.reference))
    if not args.shard:
        print(f"Plots: {Path(out) / 'report' / 'plots'}/ (full report: {Path(out) / 'report' / 'report.md'})")
    print(f"wall time {wall:.0f} s")


def _reference(path: str | None, no_reference: bool) -> str | None:
    if path and not no_reference and not Path(path).exists():
        print(f"(no reference run at {path}: nothing to compare with)")
        return None
    return None if no_reference else path


def cmd_demo(args) -> None:
    """Both regimes, computed afresh (each folder's earlier records are removed), each next to its
    committed reference: RULER (cpu-quick), then prose (``PROSE_DEMO`` into ``<out>/prose``), on one loaded
    model and tokenizer."""
    start = time.perf_counter()
    loaded = []

    def load_once(run_args):
        if not loaded:
            loaded.append(_load(run_args))
        return loaded[0]

    cmd_reproduce(argparse.Namespace(
        preset="cpu-quick", model=args.model, context_length=None, n_examples=None, out=args.out, shard=None,
        query_aware=False, decode_batch=args.decode_batch, data_seed=0, fresh=True,
        reference=_reference(args.reference, args.no_reference)), load_once)
    if not args.no_prose:
        demo_prose(args, load_once)
    print(f"demo wall time (both regimes) {time.perf_counter() - start:.0f} s")


def demo_prose(args, load=None) -> None:
    """The demo's prose part: ``PROSE_DEMO`` afresh into ``<out>/prose``, next to ``--prose-reference``
    (``load(args)``: the model and tokenizer; unset: ``_load``)."""
    from evaluation.tasks.prose import cli as prose

    out = Path(args.out) / "prose"
    _clear_results(out)
    run_args = parser().parse_args(["prose", "run", "--split", PROSE_DEMO["split"], "--context", str(PROSE_DEMO["context"]),
                                    "--presses", *PROSE_DEMO["presses"], "--out", str(out)])  # the other options at their defaults
    vars(run_args).update(PROSE_DEMO, model=args.model, scored_tokens=prose.SCORED_TOKENS, out=out, threads=0,
                          no_report=True)
    prose.cmd_run(run_args, load or _load, _model_name)
    reference = _reference(args.prose_reference, args.no_reference)
    if reference:
        from evaluation.report.side_by_side import prose_comparison_markdown

        print("\n" + prose_comparison_markdown(out, reference))


def cmd_presses(args) -> None:
    from evaluation.report.press_info import family_table, press_detail

    if args.name:
        try:
            print("\n".join(press_detail(args.name)))
        except ValueError as error:
            sys.exit(f"kvprob presses: {error}")
    else:
        print("\n".join(family_table(every=args.all)))


def cmd_recommended(args) -> None:
    from evaluation.report import recommended

    recs = recommended.rows()
    if args.write:
        path = Path(args.write)
        try:
            path.write_text(recommended.replace_block(path.read_text(), recs))
        except ValueError as error:
            sys.exit(f"kvprob recommended: {path}: {error}")
        print(f"kvprob recommended: rewrote the table in {path}")
    elif args.markdown:
        print(recommended.markdown(recs))
    else:
        print("\n".join(recommended.text(recs)))


def cmd_recall(args):
    from evaluation.tasks.recall import cli as recall

    if args.recall_command == "run":
        return recall.cmd_run(args, _load, _model_name)
    return recall.cmd_report(args)


def cmd_prose(args):
    from evaluation.tasks.prose import cli as prose

    if args.prose_command == "run":
        return prose.cmd_run(args, _load, _model_name)
    return prose.cmd_report(args)


def cmd_train_gate(args) -> dict:
    from evaluation.tasks.prose.gate import cmd_train_gate as train_gate

    return train_gate(args, _load)


def cmd_bench(args, rest) -> None:
    from evaluation.bench.__main__ import main as bench_main

    bench_main(rest)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvprob", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter, **kwargs)

    g = add("generate", "generate (and cache) a dataset, print its task counts")
    data_options(g)

    names = " ".join(PRESSES)
    r = add("run", "run a sweep (resumable: rerun the same command to finish it)",
            epilog=wrapped(f"press names (kvprob presses describes each): {names}"))
    data_options(r)
    r.add_argument("--presses", nargs="+", required=True, metavar="NAME",
                   help="registry names, listed below (the full cache is always run as the reference)")
    r.add_argument("--ratios", nargs="+", type=ratio_type, default=[0.5], help="compression ratios in [0, 1)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of the sampling presses")
    r.add_argument("--out", required=True, help="results folder")
    r.add_argument("--shard", default=None, help="i/n: run only shard i of n (by example), e.g. for a job array")
    r.add_argument("--query-aware", action="store_true", help="append the question to the compressed context")
    r.add_argument("--decode-batch", type=decode_batch, default="auto", help=DECODE_BATCH_HELP)

    m = add("merge", "join shard files into one results file")
    m.add_argument("--out", required=True, help="merged .jsonl file")
    m.add_argument("shards", nargs="+", help="shard .jsonl files")

    rep = add("report", "tables (CSV, Markdown) and plots of a results folder")
    rep.add_argument("--results", required=True, help="results folder or .jsonl file")
    rep.add_argument("--out", default=None, help="unset: <results>/report")
    rep.add_argument("--title", default="kvpress-prob results", help="report title")
    rep.add_argument("--kvpress-folders", action="store_true", help="also write KVPress-compatible folders")

    c = add("compare", "sampling presses against the best top-k press at each ratio, paired on examples")
    c.add_argument("--results", nargs="+", required=True, help="results folders or .jsonl files (one split)")
    c.add_argument("--split", required=True, choices=["development", "test"], help="which split the results are")
    c.add_argument("--out", default=None, help="markdown file to write (unset: print only)")
    c.add_argument("--presses", nargs="+", default=None,
                   help="only these presses, on the examples every one of them completed (unset: all)")

    presets = "; ".join(f"{k}: {', '.join(v['presses'])}" for k, v in PRESETS.items())
    rp = add("reproduce", "run a preset end to end and report it", epilog=wrapped(f"presets (evaluation/presets.py): {presets}"))
    rp.add_argument("--preset", required=True, choices=sorted(PRESETS), help="named sweep")
    model_option(rp)
    rp.add_argument("--context-length", type=positive_int("--context-length"), default=None,
                    help="override the preset's context length")
    rp.add_argument("--n-examples", type=positive_int("--n-examples"), default=None,
                    help="override the preset's example count")
    rp.add_argument("--data-seed", type=int, default=0, help="RULER data seed (0 = development, 1 = test split)")
    rp.add_argument("--out", default=None, help="unset: results/<preset>[-<length>]")
    rp.add_argument("--fresh", action="store_true",
                    help="remove the folder's earlier results and report first, so that everything is recomputed")
    rp.add_argument("--reference", default=None, help="a results folder to print this run's averages next to")
    rp.add_argument("--shard", default=None, help="i/n: one shard (merge and report afterwards)")
    rp.add_argument("--query-aware", action="store_true", help="append the question to the compressed context")
    rp.add_argument("--decode-batch", type=decode_batch, default="auto", help=DECODE_BATCH_HELP)

    d = add("demo", "RULER (cpu-quick) and prose (a few essays) computed afresh, each next to its committed run")
    model_option(d)
    d.add_argument("--out", default=DEMO_OUT, help="results folder (its earlier results are removed); prose in <out>/prose")
    d.add_argument("--reference", default=DEMO_REFERENCE, help="committed RULER run to compare with")
    d.add_argument("--prose-reference", default=PROSE_DEMO_REFERENCE, help="committed prose run to compare with")
    d.add_argument("--no-reference", action="store_true", help="do not compare")
    d.add_argument("--no-prose", action="store_true", help="the RULER part only")
    d.add_argument("--decode-batch", type=decode_batch, default="auto", help=DECODE_BATCH_HELP)

    ps = add("presses", "the registered presses by origin and family, with their status")
    ps.add_argument("name", nargs="?", default=None, help="one press: its parts, settings and status")
    ps.add_argument("--all", action="store_true", help="every registered name, with its status and finding")

    rc = add("recommended", "the four recommendations of the registry: what each is for, its quality on the test "
             "split, its price over snapkv's and the evidence")
    rc.add_argument("--markdown", action="store_true", help="the README's table (markdown) and its note")
    rc.add_argument("--write", metavar="FILE", default=None,
                    help="rewrite the table between the recommended-table markers in FILE (e.g. README.md)")

    from evaluation.tasks.prose.cli import add_parser as add_prose
    from evaluation.tasks.recall.cli import add_parser as add_recall

    add_prose(sub, add, ratio_type, positive_int, model_option)
    from evaluation.tasks.prose.gate import add_parser as add_train_gate

    add_train_gate(add, positive_int, model_option)
    add_recall(sub, add, ratio_type, positive_int, model_option)

    from evaluation.tasks.streaming.cli import add_parsers

    add_parsers(add, positive_int)

    sub.add_parser("bench", help="measurements: kvprob bench {speed,budget,oracle,fidelity} --help", add_help=False)
    from evaluation.gpu_check.run import parser as gpu_check_parser

    add("gpu-check", "the GPU path in one command, offline (--dry-run: the same steps on the CPU)",
        parents=[gpu_check_parser(add_help=False)])
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return cmd_bench(None, argv[1:])
    if argv[:1] == ["gpu-check"]:
        from evaluation.gpu_check.run import main as gpu_check

        return gpu_check(argv[1:])
    args = parser().parse_args(argv)
    args.argv = argv
    from evaluation.tasks.streaming.cli import cmd_stream, cmd_stream_report

    command = {"stream": lambda a: cmd_stream(a, _load, _model_name), "stream-report": cmd_stream_report,
               "generate": cmd_generate, "run": cmd_run, "merge": cmd_merge, "report": cmd_report,
               "reproduce": cmd_reproduce, "demo": cmd_demo, "presses": cmd_presses, "recommended": cmd_recommended,
               "compare": cmd_compare, "prose": cmd_prose,
               "recall": cmd_recall, "train-gate": cmd_train_gate}[args.command]
    try:
        command(args)
    except (FileNotFoundError, manifest.ManifestMismatch) as error:  # missing assets and paths, mixed settings
        sys.exit(f"kvprob {args.command}: {error}")


if __name__ == "__main__":
    main()
