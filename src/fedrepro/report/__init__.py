"""Reporting: aggregate per-cell `metrics.json` files into summaries, tables and plots.

- `aggregate`: load metrics, long summary/curve frames, the `dvc metrics` JSON and `dvc plots` CSV.
- `tables`: paper-style "mean ± std over seeds" tables as Markdown, LaTeX (booktabs) and CSV.
- `plots`: learning curves, per-client accuracy distributions and partition label distributions.
"""
