"""What every named prefill press keeps, as plain data, to check that a rewritten package evicts the same entries.

For every name of the catalogue (the prefill presses; decoding presses are left out) and every prefill press
named in a record or a manifest under results/ (``full`` and decoding presses left out; a record's
``name[field=value,...]`` is the press with those ``get_press`` overrides), the press compresses a prefill
of N = 96 random tokens on a tiny random Llama (2 layers, 2 KV heads, float32) at r = 0.25, 0.5 and 0.75,
seed 0. Its kept set is which of the N positions each head of each layer still holds: the rows of the
compressed cache that are not padding (bias at ``correction.padding``), matched bit for bit to the rows of
a plain prefill's keys, or, for a press that masks instead of evicting (kvpress's AdaKV, KVzip), the
positions it does not mask. Rows that match no prefix key (an evicted-set summary's entries) are counted.

Ties: a kept set may hang on two scores (or a uniform draw and a threshold) equal up to rounding, and then
differ between machines without a bug. Each press therefore also runs on two copies of the model whose
weights are scaled by 1 +- 1e-3 x (fixed Gaussian noise): a head whose kept set is not the same on all three
is recorded as tied and not compared. Float32 rounding (summation order, kernels) moves a score by about 1e-6
of its size, far below the 1e-3 that flags a tie, so what is compared does not depend on the machine.

Presses that cannot run here: kvpress's ObservedAttentionPress (``h2o``) needs eager attention, and runs on
an eager copy of the model (recorded as ``"attn": "eager"``). A name that does not build at the recording
commit is recorded under ``"unbuildable"`` with its error. A press that raises on the tiny model is recorded
under ``"failed"`` with the error (the registry snapshot, tests/data/registry-*.json, still compares its
fields). Run as a script, it writes ``tests/data/kept-<commit>.json``:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python tests/kept_snapshot.py 7ab10c4

(it was run at that commit, with that commit's module paths; the imports here are the layered ones since).
"""

from __future__ import annotations

import functools
import glob
import json
import shlex
import sys
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

RATIOS = (0.25, 0.5, 0.75)
N = 96  # > SnapKV's window of 64
EPS = 1e-3
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def _tokenizer_once() -> None:
    """kvpress's KVzipPress loads the tokenizer on every prefill (about 1 s): load it once."""
    import functools

    from kvpress.presses import kvzip_press

    if not hasattr(kvzip_press.AutoTokenizer, "_kept_once"):
        load = functools.lru_cache(maxsize=4)(kvzip_press.AutoTokenizer.from_pretrained)
        kvzip_press.AutoTokenizer = type("AutoTokenizer", (), {"from_pretrained": staticmethod(load), "_kept_once": True})


def tiny(attn: str = "sdpa", scale: float = 0.0) -> LlamaForCausalLM:
    """The tiny float32 Llama, its weights scaled by 1 + scale x (fixed noise) when ``scale`` is not 0."""
    _tokenizer_once()
    from tests.conftest import VOCAB

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation=attn, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    model = LlamaForCausalLM(config)
    from kvpress_prob.models import embedded_model_path

    model.config._name_or_path = str(embedded_model_path())  # KVzip's replay loads the tokenizer from here
    model = model.eval()
    if scale:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def record_sources(pattern: str = "results.jsonl") -> dict[str, str]:
    """Every press named in results/**/<pattern> records and in a manifest's ``--presses`` (results/archive/
    included) -> the first file naming it (absolute path, files in sorted order)."""
    names: dict[str, str] = {}
    for path in sorted(glob.glob(str(ROOT / "results" / "**" / pattern), recursive=True)):
        for line in Path(path).read_text().splitlines():
            if line.strip() and isinstance(record := json.loads(line), dict) and isinstance(record.get("press"), str):
                names.setdefault(record["press"], path)
    for path in sorted(glob.glob(str(ROOT / "results" / "**" / "*manifest*.json"), recursive=True)):
        for run in json.loads(Path(path).read_text()).get("runs", []):
            words = shlex.split(run.get("command") or "")
            if "--presses" in words:
                for word in words[words.index("--presses") + 1:]:
                    if word.startswith("--"):
                        break
                    names.setdefault(word, path)
    return names


def record_names() -> set[str]:
    """Every press named in results/**/results.jsonl and in a manifest's ``--presses`` (results/archive/ included)."""
    return set(record_sources())


def _value(text: str):
    return {"True": True, "False": False}.get(text, text)


def build(label: str, ratio: float):
    """``get_press`` of a label ``name`` or ``name[field=value,...]`` at ``ratio``."""
    from kvpress_prob.names.registry import get_press

    name, _, rest = label.partition("[")
    overrides = dict(item.split("=", 1) for item in rest[:-1].split(",")) if rest else {}
    press = get_press(name, ratio, **{k: _value(v) for k, v in overrides.items()})
    if getattr(press, "tokenizer", False) is None:  # SpanPress: the tokenizer it would load from the model, loaded once
        press.tokenizer = _embedded_tokenizer()
    return press


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer():
    """The embedded model's tokenizer: the models here carry its path as their ``name_or_path``."""
    from transformers import AutoTokenizer

    from kvpress_prob.models import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def names() -> list[str]:
    from kvpress_prob.names.decoding import DECODING_PRESSES
    from kvpress_prob.names.registry import CATALOGUE

    wanted = set(CATALOGUE) | record_names()
    return sorted(n for n in wanted if n != "full" and n.partition("[")[0] not in DECODING_PRESSES)


def _row_hash(x: torch.Tensor) -> list[list[bytes]]:
    return [[bytes(row.numpy().tobytes()) for row in head] for head in x]


@torch.no_grad()
def plain_prefill(model, ids) -> DynamicCache:
    """The cache of a plain prefill of ``ids``: the keys a kept set is matched to."""
    full = DynamicCache()
    model.model(input_ids=ids, past_key_values=full)
    return full


@torch.no_grad()
def kept(model, press, ids, full: DynamicCache | None = None) -> tuple[torch.Tensor, list[int]]:
    """(L, H_kv, N) bool kept set of ``press`` on ``ids``, and per layer the count of held rows matching no key.
    ``full``: ``plain_prefill(model, ids)``, computed here when not given (a caller running many presses on one model and
    one ``ids`` passes it once)."""
    from kvpress_prob.correction import bias as correction

    full = plain_prefill(model, ids) if full is None else full
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    masks, unmatched = [], []
    for i, layer in enumerate(model.model.layers):
        plain = full.layers[i].keys[0]  # (H, n, d)
        h, n = plain.shape[:2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            keep = torch.ones(h, n, dtype=torch.bool)
            keep[masked[1], masked[2]] = False
            masks.append(keep)
            unmatched.append(0)
            continue
        held = cache.layers[i].keys[0]
        bias = correction.bias_of(layer.self_attn, cache)
        real = torch.ones(held.shape[:2], dtype=torch.bool) if bias is None else ~correction.is_padding(bias[0])
        keep, missing = torch.zeros(h, n, dtype=torch.bool), 0
        for head in range(h):
            where = {row: p for p, row in enumerate(_row_hash(plain[head:head + 1])[0])}
            for s, row in enumerate(_row_hash(held[head:head + 1])[0]):
                if not real[head, s]:
                    continue
                if row in where:
                    keep[head, where[row]] = True
                else:
                    missing += 1
        masks.append(keep)
        unmatched.append(missing)
    return torch.stack(masks), unmatched


def bits(mask: torch.Tensor) -> str:
    """The mask's bits (row-major, 8 to a byte, first position the high bit) in hex."""
    flat = mask.flatten().to(torch.uint8).tolist()
    flat += [0] * (-len(flat) % 8)
    return bytes(int("".join(map(str, flat[i:i + 8])), 2) for i in range(0, len(flat), 8)).hex()


def unbits(text: str, shape) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    flat = [int(b) for byte in bytes.fromhex(text) for b in f"{byte:08b}"][:count]
    return torch.tensor(flat, dtype=torch.bool).reshape(shape)


def attention_of(press) -> str:
    """``eager`` for a press that reads attention weights from eager attention (kvpress's ObservedAttentionPress)."""
    return "eager" if "ObservedAttentionPress" in repr(press) else "sdpa"


def ids() -> torch.Tensor:
    from tests.conftest import random_ids

    return random_ids(N, seed=0)


def snapshot(log=print) -> dict:
    torch.set_num_threads(1)
    models = {attn: [tiny(attn), tiny(attn, EPS), tiny(attn, -EPS)] for attn in ("sdpa", "eager")}
    x = ids()
    out: dict = {"n": N, "eps": EPS, "presses": {}, "unbuildable": {}, "failed": {}}
    for name in names():
        try:
            presses = {r: build(name, r) for r in RATIOS}
        except Exception as error:  # noqa: BLE001 - recorded, and the test checks it still fails
            out["unbuildable"][name] = f"{type(error).__name__}: {error}"[:200]
            continue
        entry = {"attn": attention_of(presses[0.5])}
        try:
            for r in RATIOS:
                runs = [kept(m, build(name, r), x) for m in models[entry["attn"]]]
                base, unmatched = runs[0]
                same = torch.stack([(m == base).all(-1) for m, _ in runs[1:]]).all(0)  # (L, H)
                entry[str(r)] = {"shape": list(base.shape), "bits": bits(base), "unmatched": unmatched,
                                 "tied": [[int(l), int(h)] for l, h in (~same).nonzero().tolist()]}
        except Exception as error:  # noqa: BLE001
            entry = {"error": f"{type(error).__name__}: {error}"[:200]}
        if "error" in entry:
            out["failed"][name] = entry["error"]
        else:
            out["presses"][name] = entry
        log(name, entry.get("error", ""))
    return out


if __name__ == "__main__":
    commit = sys.argv[1]
    path = DATA / f"kept-{commit}.json"
    data = snapshot()
    path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"{path}: {len(data['presses'])} presses, {len(data['unbuildable'])} unbuildable, "
          f"{len(data['failed'])} failed")
