"""Resumable, atomic and shardable results store.

One record per (example, configuration) result, one JSON object per line
(JSON lines). The runner appends complete lines and fsyncs after each batch,
so a SIGKILL at any moment leaves at most one truncated last line; that line is
ignored on load and cut away when the store is opened for writing. A crash
between writing a record and the runner's own bookkeeping can leave the same
work unit twice: duplicates are dropped on load, keeping the first.

Record schema (written by the runner)::

    model, dataset, data_dir, task, example_id, press, compression_ratio, seed,
    prediction, answer (list of str), score (0..100), realised_ratio, kv_bytes, seconds

A *work unit key* is (model, dataset, data_dir, example_id, press,
compression_ratio, seed), see ``KEY_FIELDS`` and ``record_key``.

One writer per file: parallel workers each write their own shard file
(``shard(units, "i/n")``) and ``merge`` joins the files afterwards.

This module imports neither torch nor kvpress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

logger = logging.getLogger(__name__)

KEY_FIELDS = ("model", "dataset", "data_dir", "example_id", "press", "compression_ratio", "seed")
COLUMNS = (
    "model", "dataset", "data_dir", "task", "example_id", "press", "compression_ratio", "seed",
    "prediction", "answer", "score", "realised_ratio", "kv_bytes", "seconds",
)
RATIO_DECIMALS = 6  # ratios are compared after rounding, so 0.1 and 0.1000000001 are one key


class StoreCorruptError(ValueError):
    """A line other than the last one of a results file is not a valid record."""


# --------------------------------------------------------------------------- helpers


def plain(obj: Any) -> Any:
    """Turn numpy scalars/arrays, tuples and Paths into plain JSON/YAML-friendly values."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):  # numpy array or scalar
        return plain(obj.tolist())
    return obj


def _json_default(obj: Any) -> Any:
    """``json.dumps`` fallback for numpy values and Paths."""
    value = plain(obj)
    if value is obj:
        raise TypeError(f"cannot store a value of type {type(obj).__name__} in a results record")
    return value


def record_key(record: dict) -> tuple:
    """The work-unit key of a record, in ``KEY_FIELDS`` order, with normalised types.

    ``compression_ratio`` becomes a float rounded to ``RATIO_DECIMALS`` places, ``seed``
    an int, the other fields str (``None`` stays ``None``).
    """
    key = []
    for field in KEY_FIELDS:
        value = record.get(field)
        if value is None or (isinstance(value, float) and value != value):  # None or NaN
            key.append(None)
        elif field == "compression_ratio":
            key.append(round(float(value), RATIO_DECIMALS))
        elif field == "seed":
            key.append(int(value))
        else:
            key.append(str(value))
    return tuple(key)


def write_atomic(path: Path | str, text: str | bytes) -> Path:
    """Write a whole file atomically: temporary file in the same folder, fsync, ``os.replace``.

    Readers see either the old file or the new one, never a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else text
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """Best-effort fsync of a folder, so that a rename or a new file survives a power cut."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _encode_lines(records: Iterable[dict]) -> bytes:
    """Serialise records as newline-terminated JSON lines."""
    lines = []
    for record in records:
        if not isinstance(record, dict):
            raise TypeError(f"a record must be a dict, got {type(record).__name__}")
        lines.append(json.dumps(record, ensure_ascii=False, default=_json_default) + "\n")
    return "".join(lines).encode("utf-8")


# --------------------------------------------------------------------------- the store


class ResultStore:
    """A JSON-lines results file that survives SIGKILL and can be resumed.

    Parameters
    ----------
    path : Path or str
        The ``.jsonl`` file; created (with its folder) on the first ``append``.
    readonly : bool
        When False (default) opening repairs the file: a truncated or corrupt last line,
        left by a killed writer, is cut away so later appends start on a fresh line.
        Use ``readonly=True`` to read a file that another process may be writing.
    """

    def __init__(self, path: Path | str, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        if not readonly:
            self.repair()

    def __repr__(self) -> str:
        return f"ResultStore({str(self.path)!r})"

    # ---- writing

    def repair(self) -> int:
        """Cut away a truncated or corrupt last line; returns the number of bytes removed.

        A last line without its newline that still parses as a whole record (a hand-edited
        file) is kept and given its newline instead.
        """
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        keep = len(data)
        if data and not data.endswith(b"\n"):
            start = data.rfind(b"\n") + 1  # 0 when the file is one partial line
            if _parse_line(data[start:]) is not None:
                with open(self.path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
                return 0
            keep = start
        else:
            # a newline-terminated but unparsable last line (e.g. a short write) is dropped too
            start = data.rfind(b"\n", 0, max(len(data) - 1, 0)) + 1
            last = data[start:].strip()
            if last and _parse_line(last) is None:
                keep = start
        removed = len(data) - keep
        if removed:
            logger.warning("%s: removed a truncated last line (%d bytes) left by an interrupted write",
                           self.path, removed)
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
        return removed

    def append(self, records: list[dict]) -> None:
        """Append complete records as JSON lines, then flush and fsync.

        The bytes go out through ``os.write`` on an ``O_APPEND`` descriptor, so a kill leaves
        the records before the interrupted one intact and at most one partial line.
        """
        if self.readonly:
            raise PermissionError(f"{self.path} was opened read-only")
        data = _encode_lines(records)
        if not data:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self.path.parent)

    # ---- reading

    def records(self) -> list[dict]:
        """All records in file order, without duplicate keys (the first one wins).

        A truncated or corrupt *last* line is ignored with a warning; a corrupt line anywhere
        else raises ``StoreCorruptError``.
        """
        if not self.path.exists():
            if self.readonly:  # a store opened for writing starts empty; a missing file to read is an error
                raise FileNotFoundError(f"no results file {self.path}")
            return []
        lines = self.path.read_bytes().split(b"\n")
        numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
        out, seen, duplicates = [], set(), 0
        for position, (lineno, line) in enumerate(numbered):
            record = _parse_line(line)
            if record is None:
                if position == len(numbered) - 1:
                    logger.warning("%s:%d: ignoring a truncated last line", self.path, lineno)
                    break
                raise StoreCorruptError(
                    f"{self.path}:{lineno}: not a valid JSON record ({line[:80]!r}...). Only the last "
                    "line of a results file may be truncated (an interrupted write); a corrupt line "
                    "in the middle means the file was edited or damaged: fix or delete that line."
                )
            key = record_key(record)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            out.append(record)
        if duplicates:
            logger.info("%s: dropped %d duplicate work units (kept the first)", self.path, duplicates)
        return out

    def load(self) -> pd.DataFrame:
        """The records as a DataFrame (``COLUMNS`` first, then any extra fields)."""
        return records_to_frame(self.records())

    def done_keys(self) -> set[tuple]:
        """Work-unit keys (see ``record_key``) already in the file."""
        return {record_key(r) for r in self.records()}

    def __len__(self) -> int:
        return len(self.records())


def _parse_line(line: bytes) -> dict | None:
    """Parse one JSON line into a dict, or None if it is not a complete JSON object."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def records_to_frame(records: list[dict]) -> pd.DataFrame:
    """Build the results DataFrame with the schema's columns first and typed ratio/seed."""
    df = pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=list(COLUMNS))
    ordered = [c for c in COLUMNS if c in df.columns] + [c for c in df.columns if c not in COLUMNS]
    df = df[ordered]
    if "compression_ratio" in df and len(df):
        df["compression_ratio"] = df["compression_ratio"].astype(float)
    if "score" in df and len(df):
        df["score"] = df["score"].astype(float)
    return df


def unique_records(paths) -> list[dict]:
    """The records of several results files (read-only), the first of each key kept."""
    records, seen = [], set()
    for path in paths:
        for record in ResultStore(path, readonly=True).records():
            key = record_key(record)
            if key not in seen:
                seen.add(key)
                records.append(record)
    return records


def results_files(path: Path | str) -> list[Path]:
    """The .jsonl files of a results folder, or the file itself; FileNotFoundError naming the path if
    it does not exist or holds no results."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such results folder or file: {path}")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no results (*.jsonl) in {path}")
    return files


def load_folders(paths) -> pd.DataFrame:
    """``load_results`` over every results file of each folder or file in ``paths`` (``results_files``:
    a missing path is refused by name)."""
    return load_results(*[f for path in paths for f in results_files(path)])


def load_results(*paths: Path | str) -> pd.DataFrame:
    """Read one or more results files (read-only) into one DataFrame, duplicates dropped; a missing file
    raises FileNotFoundError."""
    return records_to_frame(unique_records(paths))


# --------------------------------------------------------------------------- sharding


_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse_shard(spec: str) -> tuple[int, int]:
    """Parse ``"i/n"`` (1-based, 1 <= i <= n) into ``(i, n)``; ValueError otherwise."""
    match = _SHARD_RE.match(spec) if isinstance(spec, str) else None
    if match:
        i, n = int(match.group(1)), int(match.group(2))
        if 1 <= i <= n:
            return i, n
    raise ValueError(f"--shard must have the form i/n with 1 <= i <= n (e.g. --shard 2/4), got {spec!r}")


def default_item_key(item: Any) -> Any:
    """Key used to shard an item: the work-unit key of a record-like dict, else the item."""
    if isinstance(item, dict):
        if "example_id" in item:
            return record_key(item)
        return tuple(sorted((str(k), repr(plain(v))) for k, v in item.items()))
    return item


def stable_hash(key: Any) -> int:
    """A hash of a key that is the same in every process and Python run (sha1 of its repr)."""
    value = plain(key)
    if isinstance(value, list):
        value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return int.from_bytes(hashlib.sha1(repr(value).encode("utf-8")).digest()[:8], "big")


def shard(items: list, spec: str | None, key: Callable[[Any], Any] | None = None) -> list:
    """The items of shard ``spec`` ("i/n"), in their input order.

    An item goes to shard ``stable_hash(key(item)) % n + 1``: the n shards partition the
    items, and which shard an item lands in does not depend on the list's order or on the
    other items. ``key`` defaults to ``default_item_key``; pass e.g.
    ``key=lambda u: u["example_id"]`` to keep all configurations of an example together.
    ``spec=None`` returns every item.
    """
    if spec is None:
        return list(items)
    i, n = parse_shard(spec)
    key = key or default_item_key
    return [item for item in items if stable_hash(key(item)) % n == i - 1]


# --------------------------------------------------------------------------- merging


def merge(paths: list[Path | str], out: Path | str) -> int:
    """Join shard files into one store at ``out``, dropping duplicate keys (first file wins).

    ``out`` is written atomically and may be one of the inputs. Returns the record count.
    """
    records = unique_records(paths)
    write_atomic(Path(out), _encode_lines(records))
    return len(records)
