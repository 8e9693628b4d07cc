"""Federated self-supervised learning: batched two-view augmentation and the SSL objectives."""
