"""The proposal layer: distributions pi over the prefix of one layer, one per KV head, that the samplers draw from."""
