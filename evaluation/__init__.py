"""Evaluation harness for kvpress-prob: datasets, metrics, runner, results store, aggregation and reports."""
