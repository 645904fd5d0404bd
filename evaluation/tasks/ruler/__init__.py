"""RULER: the offline generator (``offline``), kvpress's set from the hub (``hub``), their texts and words, needle positions."""
