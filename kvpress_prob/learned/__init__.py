"""What is learned offline from a model's development contexts (KVzip's labels, the gates, the per-head budget profile)."""
