"""From a kvpress top-k press to the probabilistic press one change at a time: ``steps`` (the configurations), ``run`` (scores and needle survival), ``report``."""
