"""The name layer: press names as points of a grid, the catalogue of what ships, and the registry that builds them."""
