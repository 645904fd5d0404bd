"""The decoding layer: eviction while generating (the decoding press, its rounds, layer budgets, decoding scorers)."""
