"""One configuration's records in the folder layout of kvpress's ``evaluate.py``: predictions.csv, metrics.json,
config.yaml (``kvprob report --kvpress-folders``)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from evaluation.store.results import plain, write_atomic


METRIC_NAMES = {"ruler": "string_match", "longbench": "qa_f1"}
"""Metric name used in ``metrics.json`` per dataset (kvpress' ruler scorer writes
``{task: {"string_match": x}}``); other datasets use ``"score"``."""


def kvpress_folder_name(dataset: str, data_dir: str | None, model: str, press: str, ratio: float) -> str:
    """``<dataset>__<data_dir>__<model with / as -->__<press>__<ratio:.2f>``, as kvpress names it."""
    parts = [dataset, str(data_dir) if data_dir else "", model.replace("/", "--"), press, f"{ratio:.2f}"]
    return "__".join(p for p in parts if p)


def write_kvpress_folder(
    root: Path | str,
    df_config: pd.DataFrame,
    dataset: str,
    data_dir: str | None,
    model: str,
    press: str,
    ratio: float,
    extra_config: dict | None = None,
) -> Path:
    """Write one configuration's results in the folder layout of kvpress' ``evaluate.py``.

    ``df_config`` holds the records of one (model, dataset, data_dir, press, ratio), one or
    more seeds. The folder (overwritten if it exists) gets, each written atomically:

    - ``predictions.csv``: example_id, task, seed, question (if present), answer (JSON list),
      predicted_answer, score, compression_ratio, realised_ratio (if present); no context.
    - ``metrics.json``: ``{task: {metric: mean score}}``, metric from ``METRIC_NAMES``; the
      mean is over examples within a seed, then over seeds; rounded to 2 decimals.
    - ``config.yaml``: dataset, data_dir, model, press_name, compression_ratio, seed (an int,
      or a list when there are several), then ``extra_config`` (it cannot override those).
    """
    folder = Path(root) / kvpress_folder_name(dataset, data_dir, model, press, ratio)
    folder.mkdir(parents=True, exist_ok=True)

    df = df_config.reset_index(drop=True)
    predictions = pd.DataFrame({"example_id": df["example_id"].astype(str), "task": df["task"]})
    predictions["seed"] = df["seed"] if "seed" in df else 0
    if "question" in df:
        predictions["question"] = df["question"]
    predictions["answer"] = [json.dumps(plain(a), ensure_ascii=False) for a in df["answer"]]
    predictions["predicted_answer"] = df["prediction"]
    predictions["score"] = df["score"].astype(float)
    predictions["compression_ratio"] = float(ratio)
    if "realised_ratio" in df:
        predictions["realised_ratio"] = df["realised_ratio"]
    write_atomic(folder / "predictions.csv", predictions.to_csv(index=False))

    metric = METRIC_NAMES.get(dataset, "score")
    per_seed = predictions.groupby(["task", "seed"])["score"].mean()
    per_task = per_seed.groupby(level="task").mean()
    metrics = {str(task): {metric: round(float(value), 2)} for task, value in per_task.items()}
    write_atomic(folder / "metrics.json", json.dumps(metrics, indent=4) + "\n")

    seeds = sorted({int(s) for s in predictions["seed"]})
    config = {
        "dataset": dataset,
        "data_dir": str(data_dir) if data_dir is not None else None,
        "model": model,
        "press_name": press,
        "compression_ratio": float(ratio),
        "seed": seeds[0] if len(seeds) == 1 else seeds,
    }
    for k, v in (extra_config or {}).items():
        config.setdefault(str(k), plain(v))
    write_atomic(folder / "config.yaml", yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    return folder
