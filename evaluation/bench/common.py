"""Shared helpers of the benchmarks: machine description, contexts, output files, timing and peak memory.

Every tensor a bench makes is created on the model's device; on CUDA every timing synchronises
the device before reading the clock and records ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import re
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evaluation.report.plots import save_png
from evaluation.report.tables import markdown_table
from evaluation.store.results import write_atomic

__all__ = [
    "machine_info",
    "load",
    "context_ids",
    "write_json",
    "write_markdown",
    "save_png",
    "markdown_table",
    "Stopwatch",
    "PeakMemory",
    "synchronize",
]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def machine_info() -> dict:
    """Platform, CPU count, library versions and the torch thread setting."""
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        kvpress_version = version("kvpress")
    except PackageNotFoundError:  # pragma: no cover
        kvpress_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": kvpress_version,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loadavg_start": loadavg(),
    }


#: Random-weight Llama shapes loaded by name (``--model tiny-random-16k``), with the embedded tokenizer: positions
#: beyond the embedded model's 8192, for memory at longer contexts (weights seeded, never trained).
RANDOM_MODELS = {
    "tiny-random-16k": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=16384),
}


def load(model_name: str | None, dtype: str | None = None):
    """(model, tokenizer) through ``kvpress_prob.load_model`` (None / 'embedded' = SmolLM2-135M), or a seeded
    random model of ``RANDOM_MODELS`` with the embedded tokenizer (its config names the embedded folder, from
    which KVzip loads the tokenizer); ``dtype`` ("float32", "bfloat16", ...; None: the device's default)."""
    from kvpress_prob import load_model

    wanted = None if dtype is None else getattr(torch, dtype)
    if model_name not in RANDOM_MODELS:
        return load_model(model_name, dtype=wanted)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvpress_prob.models import default_device_dtype, embedded_model_path

    device, dtype = default_device_dtype()
    dtype = wanted or dtype
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), attn_implementation="sdpa", bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         **RANDOM_MODELS[model_name])
    model = LlamaForCausalLM(config)
    model.config._name_or_path = str(embedded_model_path())
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def context_ids(tokenizer, length: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exactly ``length`` token ids (1, length) of a RULER context (repeated if it comes out short), on ``device``."""
    from evaluation.tasks.ruler.offline import generate_ruler

    df = generate_ruler(tokenizer, length, 1, seed)
    ids = tokenizer(df.context.iloc[0], add_special_tokens=False).input_ids
    if not ids:
        raise RuntimeError("empty RULER context")
    while len(ids) < length:
        ids = ids + ids
    return torch.tensor(ids[:length], device=device)[None]


def _plain(obj):
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, torch.Tensor):
        return _plain(obj.tolist())
    if isinstance(obj, pd.DataFrame):
        plain_index = isinstance(obj.index, pd.RangeIndex) and obj.index.name is None
        return _plain((obj if plain_index else obj.reset_index()).to_dict(orient="records"))
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    return obj


def write_json(path: Path, data: dict) -> Path:
    return write_atomic(path, json.dumps(_plain(data), indent=1, allow_nan=False) + "\n")


def write_markdown(path: Path, text: str) -> Path:
    return write_atomic(path, text)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); nothing on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock and process CPU time of a block, the device synchronised at both ends. On CUDA,
    ``cuda_peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the block (None on a CPU)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda_peak_bytes = None

    def __enter__(self):
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        if self.device.type == "cuda":
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _release_free_memory() -> None:
    """Return the C allocator's free memory to the system (glibc ``malloc_trim``), so that memory
    freed earlier is not reused unseen by the resident-set peak of the next block."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_rss_peak() -> bool:
    """Reset the kernel's high-water mark of this process's resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory of a block above what was held when it started.

    CUDA: ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` at the start (tensors only).
    CPU: the process's resident set, whose high-water mark (VmHWM) the kernel resets on entry
    (after the allocator's free memory is returned to the system, so that the block cannot reuse
    it unseen); where that is not possible, a thread samples the resident set every millisecond
    (``method`` says which). RSS counts every allocation of the process, tensors and the
    allocator's slack. ``anonymous=True`` samples the anonymous resident set (RssAnon) instead,
    from a thread at the default priority: the high-water mark also counts file-backed pages (the
    memory-mapped weights, the libraries), which the kernel drops and reloads when the machine is
    short of memory, so the rise of VmHWM can then be lower than what the block allocated.
    Attributes after the block: ``start_bytes``, ``peak_bytes``, ``extra_bytes`` = peak - start.
    """

    def __init__(self, device: torch.device | str = "cpu", anonymous: bool = False):
        self.device = torch.device(device)
        self.anonymous = anonymous

    def __enter__(self):
        synchronize(self.device)
        if self.device.type == "cuda":
            self.method = "cuda max_memory_allocated"
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return self
        _release_free_memory()
        self._field = "RssAnon" if self.anonymous and _status_kib("RssAnon") is not None else "VmRSS"
        self.start_bytes = 1024 * (_status_kib(self._field) or 0)
        self._thread = None
        if self._field == "VmRSS" and _reset_rss_peak() and _status_kib("VmHWM") is not None:
            self.method = "RSS high-water mark (VmHWM)"
        else:
            self.method = f"{self._field} sampled every 1 ms"
            self._samples, self._stop = [self.start_bytes], threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        try:  # a niced process's sampler keeps the default priority, so that it still samples often
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
        except (OSError, AttributeError):
            pass
        if self._field == "RssAnon":  # /proc/self/statm: resident - shared pages = anonymous, cheap to read
            page, fd = os.sysconf("SC_PAGE_SIZE"), os.open("/proc/self/statm", os.O_RDONLY)
            try:
                while not self._stop.wait(0.001):
                    resident, shared = os.pread(fd, 128, 0).split()[1:3]
                    self._samples.append((int(resident) - int(shared)) * page)
            finally:
                os.close(fd)
            return
        while not self._stop.wait(0.001):
            self._samples.append(1024 * (_status_kib(self._field) or 0))

    def __exit__(self, *exc):
        synchronize(self.device)
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is None:
            self.peak_bytes = 1024 * _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self._samples + [1024 * (_status_kib(self._field) or 0)])
        self.extra_bytes = self.peak_bytes - self.start_bytes
        return False


def machine_markdown(info: dict) -> str:
    keys = ["platform", "processor", "cpu_count", "cuda_device", "torch", "transformers", "kvpress", "torch_threads",
            "loadavg_start", "loadavg_end"]
    lines = [f"- {k}: {info.get(k)}" for k in keys if k in info]
    return "\n".join(lines) + "\n"
