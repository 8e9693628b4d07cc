"""The package version (pyproject.toml `version`), recorded in every shard's manifest."""

__version__ = "0.1.0"
