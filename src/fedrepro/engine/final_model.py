"""The final model a cell keeps: what it holds, gathering it during the run, writing and reading it.

A cell with a global model keeps `FINAL_MODEL` beside its metrics.json (engine/run.py): the
method's server state and torch's random state right after the last aggregation, and the
evaluation records. A derived fine-tuning row re-scores it without training (finetune.py). The
round loop gathers it (`FinalModel`, the cell's `final`); `save_final` writes it with the
checkpoints' writer, `read_final` reads it back and says why a file is not believed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..custody import identity_mismatch
from ..registry import ConfigError
from .checkpoints import CheckpointRejected, read_state, write_state

#: The final-model file a cell with a global model keeps beside its metrics.json.
FINAL_MODEL = "final_model.pt"
#: Its keys (its format).
KEYS = ("identity", "round", "server", "rng", "history", "per_round")


class FinalModel:
    """What the final-model file will hold, as the round loop gathers it: `state`, taken right after
    the last round's aggregation (before its evaluation), and `records` (the evaluation history and
    the per-round records) after the last round."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.records: tuple[list, dict] | None = None

    def take_state(self, engine) -> None:
        """What a fine-tuning row starts from: the round, the server state and torch's global random state."""
        rng = {"cpu": torch.get_rng_state()}
        if engine.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(engine.device)
        self.state = {"round": engine.round, "server": dict(engine.method.server), "rng": rng}


def save_final(final: FinalModel, path: Path, identity: dict[str, Any]) -> None:
    """Write the cell's final model (atomically, with torch.save) carrying the cell's `identity`."""
    history, per_round = final.records
    write_state(path, {"identity": identity, **final.state, "history": history, "per_round": per_round})


def read_final(path: Path, base_identity: dict[str, Any], device: torch.device, training: dict[str, Any]) -> dict[str, Any]:
    """The final-model file's state, or ConfigError naming the file and why it is not believed
    (damaged, foreign: another cell's or partition's, or inconsistent with the cell's rounds)."""
    try:
        state = read_state(Path(path), device, KEYS, "final model")
    except CheckpointRejected as exc:
        raise ConfigError(f"final model {path} {exc}; retrain its cell") from None
    problem = identity_mismatch(state["identity"], base_identity)
    if problem:
        raise ConfigError(f"final model {path} belongs to another cell or partition ({problem}); "
                          f"allowed: the final model of {base_identity['label']}/seed{base_identity['seed']}")
    rounds = training["rounds"]
    evaluated = [r for r in range(1, rounds + 1) if r % training["eval_every"] == 0 or r == rounds]
    history, per_round = state["history"], state["per_round"]
    consistent = (state["round"] == rounds and isinstance(history, list) and all(isinstance(h, dict) for h in history)
                  and [h.get("round") for h in history] == evaluated and isinstance(per_round, dict)
                  and all(isinstance(per_round.get(k), list) and len(per_round[k]) == rounds for k in ("up", "down", "train_loss"))
                  and isinstance(state["server"], dict) and isinstance(state["rng"], dict)
                  and isinstance(state["rng"].get("cpu"), torch.Tensor))
    if not consistent:
        raise ConfigError(f"final model {path} is inconsistent with the cell's {rounds} rounds (evaluated: "
                          f"{evaluated[:5]}{'...' if len(evaluated) > 5 else ''}); retrain its cell")
    return state
