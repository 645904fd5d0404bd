"""Shared fixtures: tiny random Llama / Qwen3 models built from a config, the embedded tokenizer."""

from contextlib import contextmanager

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 49152  # the embedded tokenizer's, so tiny models run through the kvpress pipeline


def pytest_configure(config):
    """One torch thread: the tests' models are small and run op by op, and on a loaded 2-core machine
    OpenMP's synchronisation on every op dominates (the suite took 8 min 38 s on 2 threads, 2 min 43 s
    on one, at a load average of 5)."""
    torch.set_num_threads(1)


def tiny_model(arch: str, dtype=torch.float32, layers: int = 3):
    """A randomly initialised model: 4 query heads, 2 KV heads (GQA), head_dim 16.

    Qwen3's q-norm and k-norm gains get seeded random values in [0.5, 1.5) (a fresh Qwen3 has ones):
    with unit gains every key's norm is sqrt(head_dim) = 4 up to 4e-5, so K-norm and other norm-based
    scores would rank rounding noise, and a comparison of two code paths would depend on the machine."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="sdpa", eos_token_id=2, bos_token_id=1, pad_token_id=2,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
        random_norm_gains(model)
    # its vocabulary is the embedded tokenizer's: presses that read word boundaries (SpanPress) load it from here
    from kvpress_prob.models import embedded_model_path

    model.config._name_or_path = str(embedded_model_path())
    return model.to(dtype).eval()


@pytest.fixture(params=["llama", "qwen3"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tokenizer():
    from kvpress_prob.models import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def random_norm_gains(model, seed: int = 1):
    """Seeded random gains in [0.5, 1.5) for every q-norm and k-norm weight (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


#: Relative gaps below this are ties: two code paths computing the same scores differ by about 1e-7 of
#: their size (float32 rounding, summation order); 1e-5 leaves a factor of about 50.
TIE = 1e-5


def boundary_gap(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per head (..., n) -> (...): the gap between the k-th and the (k+1)-th largest score, relative to the
    head's largest |score|. Below ``TIE`` the top-k set is decided by rounding, not by the scores: a test
    that compares top-k sets of two code paths compares them only where the gap is larger."""
    top = scores.double().topk(k + 1, dim=-1).values
    return (top[..., k - 1] - top[..., k]) / scores.double().abs().amax(-1).clamp_min(1e-30)


@contextmanager
def greedy_margins(model):
    """Inside: every forward's last-position logits' gap between the largest and the second largest, relative
    to the largest |logit|, appended (the smallest over the batch) to the yielded list. A greedy answer decided
    by a gap below ``TIE`` is decided by rounding: two code paths (batched and one at a time, two kernels)
    may then differ without a bug, so a test comparing their text first asserts every gap exceeds ``TIE``."""
    margins: list[float] = []

    def hook(module, args, output):
        last = output[:, -1].double()
        top = last.topk(2, dim=-1).values
        margins.append(float(((top[:, 0] - top[:, 1]) / last.abs().amax(-1).clamp_min(1e-30)).min()))

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield margins
    finally:
        handle.remove()


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def seen_before_each_layer(model, press, ids: torch.Tensor, look) -> dict[int, object]:
    """Run ``press`` over a prefill of ``ids`` and return, per layer index, what ``look(cache_layers, layer_idx)``
    says of the cache just before that layer's attention runs (a pre-hook on every attention module, removed after)."""
    from transformers import DynamicCache

    from kvpress_prob.presses.sampling import language_model

    seen = {}

    def hook(module, args, kwargs):
        seen[module.layer_idx] = look(kwargs["past_key_values"].layers, module.layer_idx)

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in language_model(model).layers]
    try:
        with press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
    finally:
        for handle in handles:
            handle.remove()
    return seen
