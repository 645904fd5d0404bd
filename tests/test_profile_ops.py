"""The op profile of a prefill (evaluation/bench/speed/profile_ops.py) on a tiny model: every operation falls in a
phase and a kind; a KVzip press's reconstruction attention is the fused one (no SDPA, no scoring product after
it), snapkv's prefill is all prefill; the labels are removed afterwards."""

import torch

from evaluation.bench.speed import profile_ops
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model


def test_phases_and_kinds_of_a_kvzip_prefill_and_snapkv():
    model, ids = tiny_model("llama"), random_ids(300, seed=4)
    with torch.no_grad():
        kvzip = profile_ops.profile_press(model, ids, "topk_kvzip_global", 0.5)["seconds"]
        snapkv = profile_ops.profile_press(model, ids, "snapkv", 0.5)["seconds"]
    phases = {key.split("/")[0] for key in kvzip}
    assert {"prefill", "reconstruction"} <= phases <= set(profile_ops.PHASES) | {"other"}
    assert kvzip["reconstruction/fused attention"] > 0 and kvzip["prefill/sdpa"] > 0
    assert "reconstruction/sdpa" not in kvzip and "scoring/matmul" not in kvzip and "scoring/softmax" not in kvzip
    assert kvzip["reconstruction/mlp"] > 0 and kvzip["reconstruction/projections"] > 0
    assert {key.split("/")[0] for key in snapkv} <= {"prefill", "other"} and snapkv["prefill/sdpa"] > 0
    layer = language_model(model).layers[0]
    assert not layer.mlp._forward_pre_hooks and not layer.self_attn.q_proj._forward_hooks
