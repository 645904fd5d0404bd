"""Artefacts learned offline for a model and shipped as package data: the per-head budget profile (``profile``)."""
