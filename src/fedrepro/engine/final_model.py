"""The final model a cell keeps: what it holds, gathering it during the run, writing and reading it.

A cell with a global model keeps `FINAL_MODEL` beside its metrics.json (engine/run.py): the
method's server state and torch's random state right after the last aggregation, and the
evaluation records. A derived fine-tuning row re-scores it without training (finetune.py). The
round loop gathers it (`FinalModel`, the cell's `final`); `save_final` writes it with the
checkpoints' writer (the cell's provenance.json records its sha256: `kept_final`), `read_final`
reads it back and says why a file is not believed: too large for the cell, damaged, foreign, not
the cell's finished run, tensors the row's model or torch's random generator cannot take, or not
the file its cell kept. A forged file of the right layout cannot be told from a real one
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from ..custody import identity_mismatch
from ..io import FileTooLarge, read_json, read_regular, sha256_file
from ..registry import ConfigError
from .checkpoints import CheckpointRejected, load_state, write_state

#: The final-model file a cell with a global model keeps beside its metrics.json.
FINAL_MODEL = "final_model.pt"
#: Its keys (its format).
KEYS = ("identity", "round", "server", "rng", "history", "per_round")
#: The most bytes a final model may hold beyond its server state: a fixed allowance and, for the
#: evaluation records, so many per client and evaluated round (`size_limit`).
SLACK_BYTES, RECORD_BYTES = 16 << 20, 1 << 10


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


def save_final(final: FinalModel, path: Path, identity: dict[str, Any]) -> str:
    """Write the cell's final model (atomically, with torch.save) carrying the cell's `identity`;
    its sha256 (what the cell's provenance.json records: `kept_final`)."""
    history, per_round = final.records
    write_state(path, {"identity": identity, **final.state, "history": history, "per_round": per_round})
    return sha256_file(path)


def kept_final(path: Path) -> dict[str, Any] | None:
    """What the provenance.json beside the final model `path` records of the final model its cell
    kept ({"file", "sha256"}, engine/run.py), or None: a cell trained before final models were
    kept (or recorded), or no readable provenance.json."""
    try:
        doc = read_json(Path(path).parent / "provenance.json")
    except (OSError, ValueError):
        return None
    kept = doc.get("final_model") if isinstance(doc, dict) else None
    return kept if isinstance(kept, dict) and isinstance(kept.get("sha256"), str) else None


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(_tensor_bytes(v) for v in values)


def size_limit(server: dict[str, Any], clients: int, evaluated: int) -> int:
    """The most bytes the final model of a cell whose fresh server state is `server` may hold: the
    server state once per client and twice more (a method may keep a model per client, methods/fedamp.py),
    torch's random states and the evaluation records of `evaluated` rounds."""
    return (clients + 2) * _tensor_bytes(server) + SLACK_BYTES + RECORD_BYTES * evaluated * (clients + 1)


def _layout(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def layout_problem(got: Any, want: Any, key: str) -> str | None:
    """Where `got` (a state read from a file) differs from `want` (the state the cell holds at its
    start) in layout, or None: a tensor of another dtype or shape, a value of another type, a key
    missing, or unknown to a dict of tensors (a model's parameters). Other dicts may gain keys in
    training (methods/fedmix.py's pool, fedamp.py's models), which are not compared."""
    if want is None:
        return None
    if isinstance(want, torch.Tensor):
        fits = isinstance(got, torch.Tensor) and (got.dtype, got.shape) == (want.dtype, want.shape)
        return None if fits else f"{key} is {_layout(got)}; expected {_layout(want)}"
    if type(got) is not type(want):
        return f"{key} is {_layout(got)}; expected {_layout(want)}"
    if isinstance(want, dict) and want:
        missing = [k for k in want if k not in got]
        unknown = [k for k in got if k not in want] if all(isinstance(v, torch.Tensor) for v in want.values()) else []
        if missing or unknown:
            return f"{key}.{(missing or unknown)[0]} is {'missing' if missing else 'unknown'}"
        return next((p for k in want if (p := layout_problem(got[k], want[k], f"{key}.{k}"))), None)
    return None


def read_final(path: Path, base_identity: dict[str, Any], engine) -> tuple[dict[str, Any], str]:
    """The final-model file's state and sha256, or ConfigError naming the file and why it is not
    believed: too large for the cell, damaged, foreign (another cell's or partition's),
    inconsistent with the cell's rounds, tensors that do not fit the `engine`'s freshly set-up
    server state or torch's random generator, or not the file its cell kept (`kept_final`)."""
    path, training = Path(path), engine.training
    rounds = training["rounds"]
    evaluated = [r for r in range(1, rounds + 1) if r % training["eval_every"] == 0 or r == rounds]
    retrain = f"retrain its cell (snakemake --forcerun {path.parent / 'metrics.json'})"
    try:
        if path.is_symlink():
            raise CheckpointRejected("is not a regular file")
        data = read_regular(path, size_limit(engine.method.server, len(engine.clients), len(evaluated)))
        state = load_state(io.BytesIO(data), engine.device, KEYS, "final model")
    except FileTooLarge as exc:
        raise ConfigError(f"final model {path} holds {exc.strerror} (its cell's model and records); {retrain}") from None
    except OSError as exc:
        raise ConfigError(f"final model {path} cannot be read ({exc.strerror}); {retrain}") from None
    except CheckpointRejected as exc:
        raise ConfigError(f"final model {path} {exc}; {retrain}") from None
    problem = identity_mismatch(state["identity"], base_identity)
    if problem:
        raise ConfigError(f"final model {path} belongs to another cell or partition ({problem}); "
                          f"allowed: the final model of {base_identity['label']}/seed{base_identity['seed']}")
    history, per_round = state["history"], state["per_round"]
    consistent = (state["round"] == rounds and isinstance(history, list) and all(isinstance(h, dict) for h in history)
                  and [h.get("round") for h in history] == evaluated and isinstance(per_round, dict)
                  and all(isinstance(per_round.get(k), list) and len(per_round[k]) == rounds for k in ("up", "down", "train_loss"))
                  and isinstance(state["server"], dict) and isinstance(state["rng"], dict)
                  and isinstance(state["rng"].get("cpu"), torch.Tensor))
    if not consistent:
        raise ConfigError(f"final model {path} is inconsistent with the cell's {rounds} rounds (evaluated: "
                          f"{evaluated[:5]}{'...' if len(evaluated) > 5 else ''}); {retrain}")
    rng = {"cpu": torch.get_rng_state()}
    if engine.device.type == "cuda" and "cuda" in state["rng"]:  # (a state saved on CUDA, fine-tuned on a CPU: unused)
        rng["cuda"] = torch.cuda.get_rng_state(engine.device)
    problem = (layout_problem(state["server"], engine.method.server, "server")
               or layout_problem({k: state["rng"][k] for k in rng}, rng, "rng"))
    if problem:
        raise ConfigError(f"final model {path} does not fit the cell's model and random generator: {problem}; {retrain}")
    sha256, kept = hashlib.sha256(data).hexdigest(), kept_final(path)
    if kept is not None and kept["sha256"] != sha256:
        raise ConfigError(f"final model {path} is not the one its cell kept (sha256 {sha256[:12]}..., its provenance.json "
                          f"records {kept['sha256'][:12]}...): it was replaced after training; {retrain}")
    return state, sha256
