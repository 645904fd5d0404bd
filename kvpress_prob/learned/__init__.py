"""What is learned offline for a model from its development contexts: KVzip's labels, the gates' training loop and
the per-head budget profile, above the presses that load them; the embedded model's artefacts ship in artefacts/."""
