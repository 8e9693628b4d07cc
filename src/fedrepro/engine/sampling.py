"""Which clients train in which round.

Owns the client-sampling schedule: every round's sampled clients, drawn once from the seed
(the same for every method, so methods are compared on the same rounds), and the inverse
view, the rounds in which each client trains (what the untrained-client rule and
metrics.json's `trained_rounds` read). `fedrepro cells` prints it without building an engine.
"""

from __future__ import annotations

import numpy as np

from ..io import derive_seed


def sampling_schedule(num_clients: int, participation: float | int, rounds: int, seed: int) -> list[list[int]]:
    """The clients of every round, drawn once from the seed: the same for every method."""
    # An integer is a count of clients, a float a fraction of them (1 = one client, 1.0 = all).
    m = participation if isinstance(participation, int) else max(1, int(round(participation * num_clients)))
    m = min(m, num_clients)
    rng = np.random.default_rng(derive_seed(seed, "client-sampling"))
    return [sorted(rng.choice(num_clients, size=m, replace=False).tolist()) for _ in range(rounds)]


def trained_rounds(schedule: list[list[int]], ids: list[int]) -> dict[int, list[int]]:
    """Client id -> the (1-based) rounds in which the schedule samples it (`schedule` indexes `ids`)."""
    out: dict[int, list[int]] = {cid: [] for cid in ids}
    for r, sampled in enumerate(schedule, 1):
        for i in sampled:
            out[ids[i]].append(r)
    return out
