"""Integrations with other tools: kvpress's evaluate.py."""
