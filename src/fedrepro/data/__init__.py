"""Data sources, partitioners and Parquet client shards."""
