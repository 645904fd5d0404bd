"""The GPU check: the correction against its dense reference (float32 and bfloat16), runner sweeps against
the kvpress pipeline (float32 with batched decoding, bfloat16) and every bench's ``--quick`` mode, on CUDA.
Skipped on a machine without CUDA; the same bfloat16 checks run on the CPU in tests/test_correction.py and
tests/test_runner.py, so the code they exercise is tested everywhere.

Run the whole check with ``python -m pytest tests/test_cuda.py -v`` on a GPU box (the benches run on
the embedded SmolLM2-135M-Instruct, which ``load_model`` puts on CUDA in bfloat16).
"""

import json

import pytest
import torch
from conftest import random_ids, tiny_model
from test_bench import check_budget_draws, check_oracle_rows
from test_correction import check_steps, run as run_correction
from test_runner import check_sweep_equals_the_pipeline, examples

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available: the GPU check runs only on a machine with a CUDA device")


# float32: as tight as on the CPU; bfloat16: tests/test_correction.py::test_bfloat16_loose's tolerance
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,tau", [("prob_min_h", 1.0), ("prob_snapkv", 2.0)])
def test_correction_matches_dense_reference_on_cuda(name, tau, dtype):
    from kvpress_prob import get_press

    model = tiny_model("llama", dtype=dtype).to("cuda")
    press = get_press(name, 0.5, temperature=tau)
    full, seen, cache = run_correction(model, press, random_ids(96).cuda(), random_ids(5, seed=1).cuda())
    assert cache.layers[0].keys.device.type == "cuda" and press.last_draw.keep.device.type == "cuda"
    assert cache.layers[0].keys.dtype == dtype
    check_steps(press, full, seen, tau, **TOLERANCE[dtype])


def test_runner_sweep_on_cuda_matches_the_pipeline(tmp_path, tokenizer):
    """Batched decoding on CUDA gives the kvpress pipeline's answers (decode_batch 1), config by config."""
    from evaluation.engine.runner import configurations, run
    from evaluation.store.results import ResultStore

    model = tiny_model("qwen3").to("cuda")
    model.generation_config.eos_token_id = 2
    configs = configurations(["snapkv", "prob_min_h", "prob_snapkv_nocorr", "h2o"], [0.25, 0.75], [0, 1])
    kwargs = dict(model_name="tiny", dataset="ruler", data_dir="64", progress=False)
    one, many = ResultStore(tmp_path / "one.jsonl"), ResultStore(tmp_path / "many.jsonl")
    assert run(model, tokenizer, examples(2), configs, one, **kwargs) == 2 * len(configs)
    run(model, tokenizer, examples(2), configs, many, decode_batch=5, **kwargs)
    key = ["example_id", "press", "compression_ratio", "seed"]
    a, b = one.load().set_index(key).sort_index(), many.load().set_index(key).sort_index()
    assert a.prediction.equals(b.prediction)
    snapkv = a.xs("snapkv", level="press").reset_index()
    assert ((snapkv.realised_ratio - snapkv.compression_ratio).abs() < 0.02).all()


def test_runner_sweep_on_cuda_in_bfloat16_matches_the_pipeline(tmp_path, tokenizer):
    """In bfloat16 (what load_model picks on CUDA), one-at-a-time decoding on the shared prefill gives the
    pipeline's answers from scratch exactly. (Batched decoding is checked in float32 above: in bfloat16 its
    other summation order can flip a greedy near-tie, 1 of 26 answers on the CPU's tiny Qwen3.)"""
    from evaluation.store.results import ResultStore

    model = tiny_model("qwen3", dtype=torch.bfloat16).to("cuda")
    check_sweep_equals_the_pipeline(model, tokenizer, ResultStore(tmp_path / "bf16.jsonl"))


def _bench(name, tmp_path, *extra):
    from evaluation.bench.__main__ import main

    assert main([name, "--quick", "--out", str(tmp_path), *extra]) == 0


def test_speed_quick_on_cuda(tmp_path):
    _bench("speed", tmp_path)
    data = json.loads((tmp_path / "speed" / "speed.json").read_text())
    assert data["status"] == "complete" and data["machine"]["device"].startswith("cuda")
    assert all(v > 0 for per_n in data["prefill_cuda_peak_bytes"].values() for v in per_n.values())
    assert {row["method"] for row in data["peak"]} == {"cuda max_memory_allocated"}
    assert {(row["press"], row["path"]) for row in data["peak"]} >= {("prob_min_h", "press"), ("prob_min_h", "engine")}


def test_budget_quick_on_cuda(tmp_path):
    """Every draw's realised ratio within the Poisson bound of its target (test_bench.check_budget_draws)."""
    _bench("budget", tmp_path)
    data = json.loads((tmp_path / "budget" / "budget.json").read_text())
    layers, heads = len(data["heatmaps"]["prob_min_h|global|0.5"]), len(data["heatmaps"]["prob_min_h|global|0.5"][0])
    check_budget_draws(data, layers, heads)


def test_oracle_quick_on_cuda(tmp_path):  # synthetic and CPU-only by design: it must still run on a GPU box
    """The written records against a dense recomputation (test_bench.check_oracle_rows)."""
    _bench("oracle", tmp_path)
    data = json.loads((tmp_path / "oracle" / "oracle.json").read_text())
    check_oracle_rows(data["instances"], data["settings"])


def test_fidelity_quick_on_cuda(tmp_path):
    _bench("fidelity", tmp_path, "--presses", "snapkv", "prob_snapkv", "prob_min_h", "--threads", "0")
    summary = json.loads((tmp_path / "fidelity" / "quick" / "summary.json").read_text())
    kl = {row["press"]: row for row in summary["kl"]}
    assert set(kl) == {"snapkv", "prob_snapkv", "prob_min_h"} and all(row["kl"] >= 0 for row in kl.values())
    assert all(row["n_examples"] == 3 for row in kl.values())


def test_shared_prefill_quick_on_cuda(tmp_path):
    _bench("shared-prefill", tmp_path)
    data = json.loads((tmp_path / "shared_prefill" / "quick" / "shared_prefill.json").read_text())
    assert data["device"].startswith("cuda") and data["speedup"] > 0
    assert data["all_identical"]  # one-at-a-time decoding of the shared prefill is the pipeline's


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: the layers are split between them")
def test_runner_over_two_gpus_matches_one_gpu(tmp_path, tokenizer):
    """``load_model(device_map=...)`` with the layers split over cuda:0 and cuda:1: every tensor stays
    on its layer's device and the runner answers as on one GPU."""
    from evaluation.engine.runner import configurations, run
    from evaluation.store.results import ResultStore
    from kvpress_prob.models import load_model

    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    layout = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
              "model.layers.2": 1, "model.norm": 1, "lm_head": 1}
    split, tok = load_model(str(tmp_path / "tiny"), dtype=torch.float32, device_map=layout)
    single, _ = load_model(str(tmp_path / "tiny"), device="cuda:0", dtype=torch.float32)
    assert split.model.layers[2].self_attn.q_proj.weight.device == torch.device("cuda:1")
    configs = configurations(["snapkv", "prob_min_h", "adakv_snapkv"], [0.5], [0])
    stores = [ResultStore(tmp_path / f"{i}.jsonl") for i in range(2)]
    for model, store in zip([split, single], stores):
        model.generation_config.eos_token_id = 2
        run(model, tok, examples(1), configs, store, model_name="tiny", dataset="ruler", data_dir="x",
            progress=False, decode_batch=3)
    key = ["press", "seed"]
    a, b = (s.load().set_index(key).prediction.sort_index() for s in stores)
    assert a.equals(b)


@pytest.mark.parametrize("dtype,bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-biasfp32"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_fused_and_sdpa_routes_on_cuda_match_float64(dtype, bias_dtype, q_len):
    """Issue 27: the compiled FlexAttention route and the SDPA route (its mask in the query's dtype,
    which CUDA's memory-efficient kernel requires: issue 25) against the float64 reference."""
    from test_fused import TOL, case, reference

    from kvpress_prob.correction import corrected_attention as attention
    from kvpress_prob.correction import corrected_flex as flex

    query, key, value, bias = (x.cuda() for x in case(dtype, bias_dtype, q_len))
    want = reference(query.cpu(), key.cpu(), value.cpu(), bias.cpu())
    for route in (flex.flex_corrected, attention.corrected_sdpa):
        got = route(query, key, value, bias, None)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double().cpu(), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("mode", ["fused", "sdpa"])
def test_a_float32_bias_decodes_in_bfloat16_on_cuda(mode):
    """Issue 25 item 2 on the device: a bias_dtype="float32" SamplingPress decodes a bfloat16 model
    on either route (the SDPA route used to hand the memory-efficient kernel a float32 mask)."""
    from transformers import DynamicCache

    from kvpress_prob import SamplingPress, attention_dispatch

    model = tiny_model("llama", dtype=torch.bfloat16).to("cuda")
    ids = random_ids(40).cuda()
    cache = DynamicCache()
    previous = attention_dispatch.set_route(corrected=mode)
    try:
        with torch.no_grad():
            with SamplingPress(compression_ratio=0.5, bias_dtype="float32")(model):
                model.model(ids[:, :32], past_key_values=cache)
            for t in range(32, 40):
                logits = model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]], device="cuda")).logits
        assert torch.isfinite(logits).all()
    finally:
        attention_dispatch.set_route(**previous)


def test_the_fused_route_compiles_once_over_a_generation():
    """A biased cache (prob_snapkv's) decoded 8 steps on the fused route: every step runs FlexAttention, and
    one compiled graph serves them all, the key length growing every step (``dynamic=True``)."""
    from evaluation.engine import press_prefill
    from evaluation.gpu_check.checks import compilations
    from kvpress_prob import get_press

    model = tiny_model("llama", dtype=torch.bfloat16).to("cuda")
    cache = press_prefill(model, random_ids(96).cuda(), get_press("prob_snapkv", 0.5))
    counted = compilations(model, cache, 96, steps=8)
    assert counted["routes"] == ["flex"] and counted["compiled"], counted
    assert counted["graphs"] == 1, counted


RAGGED_ROUTES = ["portable", "flex", "nested", "flash"]


@pytest.mark.parametrize("route", RAGGED_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 6])
def test_ragged_route_on_cuda_matches_float64(route, dtype, q_len):
    """Every route over a ragged layer on CUDA (kvpress_prob/cache/ragged_attention.py, ragged_fused.py), chosen by
    ``attention_dispatch.set_route``: fp32 within 1e-5 of the output's scale, bfloat16 within twice dense SDPA's error on the same
    entries (as tests/test_ragged_attention.py and test_ragged_routes.py on a CPU), with a bias where the route
    serves one. The nested route serves decoding steps without a bias; the flash route needs flash_attn, no
    bias, a half dtype."""
    from test_ragged_attention import _case, _dense_inputs, _reference, inputs_as
    from kvpress_prob import attention_dispatch
    from kvpress_prob.cache import ragged_attention as attention
    from kvpress_prob.cache import ragged_fused as fused

    if route == "flash" and not fused.flash_available():
        pytest.skip("the flash route needs the flash_attn package, not installed here")
    if (route == "nested" and q_len > 1) or (route == "flash" and dtype == torch.float32):
        pytest.skip(f"the {route} route does not serve q = {q_len} in {dtype} (it refuses: tests/test_ragged_routes.py)")
    with_bias = route in ("portable", "flex")
    context, query, inputs = _case(q_len, 2, with_bias, dtype, seed=4, device="cuda")
    assert context.keys.device.type == "cuda"
    previous = attention_dispatch.set_route(ragged=route)
    try:
        function = attention.choose(query.cuda())
        out = function(query.to("cuda", dtype), context).cpu().double()
    finally:
        attention_dispatch.set_route(**previous)
    reference = _reference(query.to(dtype), inputs_as(inputs, dtype))
    if dtype == torch.float32:
        assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
    else:
        keys, values, visible, bias = (t.cuda() for t in _dense_inputs(query, inputs_as(inputs, dtype), dtype))
        mask = bias.to(dtype).expand(visible.shape).masked_fill(~visible, torch.finfo(dtype).min)
        dense = torch.nn.functional.scaled_dot_product_attention(query.to("cuda", dtype), keys, values, attn_mask=mask)
        dense = (dense.transpose(1, 2).cpu().double() - reference).abs().max()
        assert (out - reference).abs().max() <= 2 * dense


def test_auto_route_on_cuda_is_flex_and_decodes_a_ragged_press():
    """On CUDA "auto" runs FlexAttention (compiled) for a ragged layer: topk_kvzip_global's cache decodes through
    it, and its logits match the portable route's on the same cache (bfloat16, 3 % of the logits' scale)."""
    import copy

    from evaluation.bench.speed.route import route
    from evaluation.engine import press_prefill
    from kvpress_prob import attention_dispatch, get_press

    model = tiny_model("llama", dtype=torch.bfloat16).to("cuda")
    cache = press_prefill(model, random_ids(96).cuda(), get_press("topk_kvzip_global", 0.5))
    token, position = torch.tensor([[5]], device="cuda"), torch.tensor([[96]], device="cuda")
    logits = {}
    for name in ("auto", "portable"):
        step_cache, out = copy.deepcopy(cache), {}
        previous = attention_dispatch.set_route(ragged=name)
        try:
            ran = route(model, lambda: out.update(logits=model(token, past_key_values=step_cache,
                                                               position_ids=position).logits.float()))
        finally:
            attention_dispatch.set_route(**previous)
        assert ran == ("ragged flex" if name == "auto" else "ragged sdpa")
        logits[name] = out["logits"]
    assert (logits["auto"] - logits["portable"]).abs().max() <= 3e-2 * logits["portable"].abs().max()
