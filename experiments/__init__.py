"""One-off studies, run from the repository root as ``python -m experiments.<study>`` (not installed)."""
