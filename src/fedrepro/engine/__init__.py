"""The training engine: one cell = one run of the federated loop."""
