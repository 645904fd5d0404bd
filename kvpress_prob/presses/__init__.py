"""The press layer: kvpress prefill presses that draw the kept entries (sampling, summaries, H2O, KVzip, spans)."""
