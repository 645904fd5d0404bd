"""The long-generation bench builds every press at the bytes of its target (experiments/decoding.py)."""

import pytest
import torch
from kvpress import DecodingPress, SnapKVPress

from experiments.decoding import build
from kvpress_prob.decoding.press import SamplingDecodingPress


def test_kvpress_baseline_holds_the_target():
    press = build("snapkv", 128, 32, 32, 0, 1)
    assert isinstance(press, DecodingPress) and isinstance(press.base_press, SnapKVPress)
    assert press.target_size == 128 and press.compression_interval == 32
    assert press.base_press.window_size == 1  # one query per step: the window must be shorter than the buffer
    chunked = build("snapkv", 128, 32, 32, 0, 32)
    assert chunked.compression_interval == 1 and chunked.base_press.window_size == 31


@pytest.mark.parametrize("dtype, expected", [(torch.float32, 127), (torch.bfloat16, 126)])
def test_corrected_press_holds_the_bytes_of_the_target(dtype, expected):
    # 128 entries of 2 x 64 values: 128 * 128 * s bytes; with a float32 bias per entry, the largest m with
    # m * (128 s + 4) <= 128 * 128 s: s = 4 -> 127 (127 * 516 = 65532 <= 65536), s = 2 -> 126 (126 * 260 = 32760)
    press = build("prob_decode_min_variance_priority_floor20", 128, 32, 32, 0, 1, head_dim=64, dtype=dtype)
    assert isinstance(press, SamplingDecodingPress) and press.target_size == expected
    assert expected * (128 * dtype.itemsize + 4) <= 128 * 128 * dtype.itemsize
    assert (expected + 1) * (128 * dtype.itemsize + 4) > 128 * 128 * dtype.itemsize


def test_uncorrected_twin_holds_the_target():
    assert build("prob_decode_min_variance_priority_floor20_nocorr", 128, 32, 32, 0, 1).target_size == 128


def test_unknown_press_is_refused():
    with pytest.raises(KeyError, match="unknown decoding press"):
        build("no_such_press", 128, 32, 32, 0, 1)
