"""The learned scorers' training: KVzip's labels and the gates' training loop, above the presses that load them."""
