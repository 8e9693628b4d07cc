"""Example fedrepro plugin (docs/plugins.md)."""
