"""The memory bench's press labels and its comparison with snapkv (evaluation/bench/memory)."""

import pandas as pd
import pytest

from evaluation.bench.memory.child import press_config
from evaluation.bench.memory.report import against_snapkv, mode_checks

MIB = 2**20


def test_a_label_with_overrides_builds_that_press():
    config = press_config("prob_min_h[budget=layer,prefill=deferred]", 0.5)
    press = config.build()
    assert (press.budget, press.prefill, press.compression_ratio) == ("layer", "deferred", 0.5)
    assert config.label == "prob_min_h[budget=layer,prefill=deferred]"
    assert press_config("snapkv", 0.25).build().compression_ratio == 0.25
    with pytest.raises(ValueError, match="brackets"):
        press_config("prob_min_h[budget=layer", 0.5)
    with pytest.raises(ValueError, match="field=value"):
        press_config("prob_min_h[layer]", 0.5)


def test_each_prefill_is_compared_with_snapkv_at_its_length():
    kv = 360 * MIB
    rows = pd.DataFrame([
        dict(case="press", press="snapkv", n=8192, extra_bytes=400 * MIB, kv_bytes=kv, seconds=30.0, repeat_seconds=[20.0]),
        dict(case="press", press="prob_min_h[budget=layer]", n=8192, extra_bytes=418 * MIB, kv_bytes=kv, seconds=30.0,
             repeat_seconds=[21.0]),
        dict(case="press", press="prob_min_h[prefill=recompute]", n=8192, extra_bytes=454 * MIB, kv_bytes=kv,
             seconds=60.0, repeat_seconds=[46.0, 45.0]),
        dict(case="press", press="snapkv", n=2048, extra_bytes=100 * MIB, kv_bytes=kv / 4, seconds=5.0, repeat_seconds=[]),
    ])
    table = against_snapkv(rows).set_index(["press", "n"])
    assert table.loc[("prob_min_h[budget=layer]", 8192), "peak rise - snapkv, in K+V"] == pytest.approx(18 / 360)
    assert table.loc[("prob_min_h[budget=layer]", 8192), "time / snapkv"] == pytest.approx(21 / 20)
    assert table.loc[("prob_min_h[prefill=recompute]", 8192), "time / snapkv"] == pytest.approx(45 / 20)
    assert table.loc[("snapkv", 2048), "seconds"] == 5.0  # no repeats: the measured run
    met = {row["target"]: row["met"] for row in mode_checks(rows)}
    assert met == {"prefill peak prob_min_h[budget=layer] - snapkv, in K+V <= 0.1": True,
                   "prefill time prob_min_h[budget=layer] / snapkv <= 1.1": True,
                   "prefill peak prob_min_h[prefill=recompute] - snapkv, in K+V <= 0.1": False,
                   "prefill time prob_min_h[prefill=recompute] / snapkv <= 2.2": False}


def test_kvzip_is_held_to_the_full_kv_above_snapkv_and_its_time_is_shown():
    kv = 180 * MIB
    rows = pd.DataFrame([
        dict(case="press", press="snapkv", n=4096, extra_bytes=208 * MIB, kv_bytes=kv, seconds=10.0, repeat_seconds=[]),
        dict(case="press", press="topk_kvzip_widest", n=4096, extra_bytes=334 * MIB, kv_bytes=kv, seconds=54.0,
             repeat_seconds=[]),
        dict(case="press", press="kvzip", n=4096, extra_bytes=(208 + 200) * MIB, kv_bytes=kv, seconds=50.0,
             repeat_seconds=[]),
    ])
    checks = {row["target"]: row for row in mode_checks(rows)}
    assert checks["prefill peak topk_kvzip_widest - snapkv, in K+V <= 1.1"]["met"] is True
    assert checks["prefill peak topk_kvzip_widest - snapkv, in K+V <= 1.1"]["value"] == pytest.approx(126 / 180)
    assert checks["prefill peak kvzip - snapkv, in K+V <= 1.1"]["met"] is False  # 200 / 180 = 1.11
    assert checks["(info) prefill time topk_kvzip_widest / snapkv"]["value"] == pytest.approx(5.4)
    assert checks["(info) prefill time topk_kvzip_widest / snapkv"]["met"] is None


def test_the_random_model_has_positions_beyond_the_embedded_model():
    from evaluation.bench.common import RANDOM_MODELS, load

    model, tokenizer = load("tiny-random-16k")
    assert model.config.max_position_embeddings == RANDOM_MODELS["tiny-random-16k"]["max_position_embeddings"] > 8192
    assert model.config.vocab_size == len(tokenizer) and model.config._attn_implementation == "sdpa"
