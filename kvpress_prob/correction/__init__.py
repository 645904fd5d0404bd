"""The correction layer: the SNIS bias on a compressed cache, the attention functions that read it (sdpa, FlexAttention) and the kvpress wrappers."""
