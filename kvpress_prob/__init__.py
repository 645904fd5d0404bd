"""kvpress-prob: probabilistic KV cache eviction with decode-time SNIS correction."""
