"""``kvprob gpu-check --dry-run`` runs end to end on the CPU with shrunk models, RECOMMENDED's price and the
fused route's compilation count included, and the shipped configs are the paper's models' shapes."""

import json

import pytest

from evaluation.cli import main as kvprob
from evaluation.gpu_check import models
from evaluation.gpu_check.run import RAGGED
from evaluation.report import price
from kvpress_prob.names.registry import RECOMMENDED


@pytest.mark.slow  # the whole GPU check's dry run: `make test-all`
def test_dry_run_end_to_end(tmp_path):
    kvprob(["gpu-check", "--dry-run", "--out", str(tmp_path), "--lengths", "96", "--decode-steps", "2",
            "--presses", "snapkv", "prob_snapkv"])
    report = json.loads((tmp_path / "cpu-dry-run" / "gpu-check.json").read_text())
    steps = report["steps"]
    assert report["dry_run"] and not report["skipped"]
    for model in ("llama-3.2-3b", "qwen3-4b"):
        assert all(check["ok"] for check in steps["accuracy"][model].values()), steps["accuracy"][model]
        assert {r["press"] for r in steps["prefill"] if r["model"] == model} == {"snapkv", "prob_snapkv", RAGGED}
        variants = {r["variant"] for r in steps["decode"] if r["model"] == model}
        assert {"full, sdpa", "prob_snapkv corrected, fused", "prob_snapkv corrected, sdpa mask",
                "prob_snapkv same kept set, plain sdpa", "snapkv, plain sdpa"} <= variants
        # the profiler names what each path runs: on the CPU the fused route's eager FlexAttention
        # computes its scores with matmuls, the SDPA routes call scaled_dot_product_attention
        assert any("scaled_dot_product" in k for k in steps["kernels"][f"{model}: full, sdpa"])
        assert not any("scaled_dot_product" in k for k in steps["kernels"][f"{model}: prob_snapkv corrected, fused"])
        routes = {r["variant"]: r["route"] for r in steps["decode"] if r["model"] == model}
        assert routes["snapkv, plain sdpa"] == "sdpa" and routes["prob_snapkv corrected, fused"] == "flex"
        assert routes["prob_snapkv corrected, sdpa mask"] == "corrected sdpa"
        # on a CPU the fused route is not compiled by us (eager FlexAttention traces its own graph each call)
        counted = steps["compilations"][model]
        assert counted["routes"] == ["flex"] and not counted["compiled"] and counted["steps"] == 2
        assert isinstance(counted["graphs"], int) and isinstance(counted["frames"], int)
        record = price.load(tmp_path / "cpu-dry-run" / "price.jsonl", model=model)
        assert list(record.index) == ["snapkv", RECOMMENDED] and (record.n == 96).all() and (record.rounds == 2).all()
        assert record.loc["snapkv", "prefill_over_snapkv"] == 1.0 and record.loc[RECOMMENDED, "decode_route"]
        # every ragged route against float64: those that serve a forward within their tolerance, the others
        # skipped with the reason (on a CPU: flash-attn's route, the nested route beyond a plain decoding step)
        ragged = steps["ragged_accuracy"][model]
        ran = {k for k, c in ragged.items() if "value" in c}
        assert all(ragged[k]["ok"] for k in ran), ragged
        assert {k.split("_")[1] for k in ran} == {"portable", "flex", "nested"}
        assert ran >= {"ragged_portable_q8_bias_bf16_max_error", "ragged_flex_q8_bias_bf16_max_error",
                       "ragged_nested_q1_bf16_max_error"}
        assert "CUDA" in ragged["ragged_flash_q1_bf16_max_error"]["skipped"]
        # the ragged press's decode step on each route, over snapkv's, the route named by the spy
        timed = {r["route"]: r for r in steps["ragged_decode"] if r["model"] == model}
        assert set(timed) == {"portable", "flex", "nested"} and timed["portable"]["auto"]
        assert {r["decoded_by"] for r in timed.values()} == {"ragged sdpa", "ragged flex", "ragged nested"}
        assert all(r["over_snapkv"] > 0 and r["press"] == RAGGED for r in timed.values())
    text = (tmp_path / "cpu-dry-run" / "gpu-check.md").read_text()
    assert "DRY RUN" in text and "## Accuracy against float64" in text and "## Kernels" in text
    assert f"## Price of RECOMMENDED = `{RECOMMENDED}`" in text and "## Compilations" in text
    assert "## Ragged cache: every attention route against float64" in text and "over snapkv" in text


@pytest.mark.parametrize("name,shape", [("llama-3.2-3b", (28, 3072, 24, 8, 128, 8192, 128256)),
                                        ("qwen3-4b", (36, 2560, 32, 8, 128, 9728, 151936))])
def test_shipped_configs_have_the_papers_shapes(name, shape):
    c = models.config(name)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == shape
    assert c.tie_word_embeddings
    with pytest.raises(ValueError, match="model must be one of"):
        models.config("llama-70b")
