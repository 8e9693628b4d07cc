"""fedrepro: a reproducible benchmark workflow for personalized and fair federated learning."""

__version__ = "0.1.0"
