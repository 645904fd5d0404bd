"""Slow references the fast paths are checked against: float64 attention written out, sharing no code with them."""
