"""RECOMMENDED with model.generate: prefill the context under the press, then generate on the compressed cache.

The press scores the context when the prefill is done; the question is then read on the compressed cache, as
kvpress's pipeline reads it. The new tokens take the context's real positions (position_ids) and the cache's
next slots (cache_position): its get_seq_length() is the kept length of a dense cache, and the context's length
of a ragged one (each head its own count). `with press(model): model.generate(prompt_ids)` also works: the press
compresses the prompt's cache at the first decoding step.
"""

import torch
from transformers import DynamicCache

from kvpress_prob import RECOMMENDED, get_press, load_model


def generate_compressed(model, context_ids, question_ids, press, **generate_kwargs):
    """``model.generate`` on ``question_ids`` after ``context_ids`` (both (1, length)), on a cache the press
    compressed; returns the question's ids followed by the generated ones."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=context_ids, past_key_values=cache)  # 1. prefill: scored and evicted when the block exits
    n, kept, q = context_ids.shape[1], cache.get_seq_length(), question_ids.shape[1]
    device = question_ids.device
    return model.generate(  # 2. generate on the compressed cache
        input_ids=question_ids, past_key_values=cache,
        attention_mask=torch.ones(1, kept + q, dtype=torch.long, device=device),
        cache_position=torch.arange(kept, kept + q, device=device),  # the cache's next slots
        position_ids=torch.arange(n, n + q, device=device)[None],  # the context's real positions
        **generate_kwargs)


if __name__ == "__main__":
    model, tokenizer = load_model()
    context = tokenizer("The key to the blue door is 4172. " * 40, return_tensors="pt").input_ids
    question = tokenizer(" What is the key to the blue door? Answer:", return_tensors="pt").input_ids
    out = generate_compressed(model, context, question, get_press(RECOMMENDED, 0.5), max_new_tokens=8, do_sample=False)
    print(tokenizer.decode(out[0, question.shape[1]:]))
