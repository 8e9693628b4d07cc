"""The engine's rooms own their work: one round walks forward through them and comes back to the
`Engine` façade (engine/engine.py) a constant number of times per round, not per client (issue 39)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

import fedrepro.engine.engine as facade
from fedrepro.engine.run import train_cell

FACADE = facade.__file__
METHODS = str(Path(facade.__file__).parents[1] / "methods")


def facade_entries(cell: dict, shards: Path, out: Path) -> Counter:
    """Entries into engine/engine.py's code from outside it while `cell` trains from engine/run.py,
    counted by who enters: 'method' (a method's module calling its tools) or 'rooms' (anything else)."""
    got: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == FACADE:
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if caller != FACADE:
                got["method" if caller.startswith(METHODS) else "rooms"] += 1

    sys.setprofile(profile)
    try:
        train_cell(cell, shards, out, progress=False)
    finally:
        sys.setprofile(None)
    return got


@pytest.mark.parametrize("vectorize", [False, True])
def test_one_fedavg_round_enters_the_facade_a_constant_number_of_times(tiny_partition, make_cell, tmp_path, vectorize):
    """k and 2k sampled clients: the rooms never call back up into the façade per client. A method
    calls its tools (the façade's verbs) per call of its local update: FedAvg's one `fit_many`, once
    per client in a sequential round and once per round in a vectorized one."""
    entries = {k: facade_entries(make_cell("fedavg", rounds=1, participation=k, vectorize=vectorize),
                                 tiny_partition[0], tmp_path / str(k)) for k in (2, 4)}
    assert entries[2]["rooms"] == entries[4]["rooms"], entries
    assert entries[4]["method"] - entries[2]["method"] == (0 if vectorize else 2), entries
