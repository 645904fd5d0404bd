"""What is learned offline for a model from its development contexts (the per-head budget profile), shipped in artefacts/."""
