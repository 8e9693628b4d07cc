"""Checkpoints: what a cell saves between rounds and when a saved one is believed.

Owns the checkpoint file (`training.checkpoint_every`; written atomically with torch.save):
the cell's identity (its hash and its shards', fedrepro.custody), the last finished round,
the method's server state, every client's state, the evaluation history and the per-round
records. A checkpoint is resumed from only when it is readable with `weights_only`, belongs
to this cell and partition, and is consistent; any other one is moved aside with a warning
and the cell starts from round 0. The file's path and the identity it carries are this module's
(`CheckpointFile`); the functions take the cell (engine.py's `Engine`) for the state they save
and restore.
"""

from __future__ import annotations

import os
import pickle
import stat
import sys
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from ..custody import cell_identity, identity_mismatch, set_aside
from ..io import atomic_path, file_kind, short_hash
from ..registry import ConfigError, show

#: The keys of a checkpoint's state (its format; unchanged since the engine was split).
KEYS = ("identity", "round", "server", "clients", "history", "per_round")


class CheckpointRejected(Exception):
    """Why a checkpoint is not resumed from (`load` moves it aside)."""


class CheckpointFile:
    """A cell's checkpoint file (`path`; None: the cell keeps no checkpoint) and the identity its
    checkpoints carry and must match to be resumed from."""

    def __init__(self, path: Path | None, cell: dict[str, Any], manifest: dict[str, Any]):
        self.path = path
        self.cell, self.manifest = cell, manifest
        self._identity: dict[str, Any] | None = None

    def identity(self) -> dict[str, Any]:
        """The cell (its hash covers every setting, a tuned cell's selected values included) and its shards."""
        if self._identity is None:  # hashing the manifest once per cell, not per checkpoint
            self._identity = cell_identity(self.cell, self.manifest, short_hash(self.cell))
        return self._identity


def save(engine, history: list, per_round: dict) -> None:
    """Write the checkpoint after the current round (nothing without a checkpoint path)."""
    if engine.checkpoint.path is None:
        return
    write_state(engine.checkpoint.path, {
        "identity": engine.checkpoint.identity(), "round": engine.round, "server": engine.method.server,
        "clients": {c.id: c.state for c in engine.clients}, "history": history, "per_round": per_round})


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write a fedrepro state file (a checkpoint, a final model) atomically with torch.save, through a
    file object: a full disk is then the OSError ENOSPC that atomic_path names the file for (torch's
    own file writer reports it as "unexpected pos"). `read_state` reads it back."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        torch.save(state, fh)


#: How the files torch.save writes begin: a zip archive, or a pickle (torch's older format).
_STATE_FILE_STARTS = (b"PK\x03\x04", b"\x80")


def never_a_checkpoint(path: Path) -> str | None:
    """What is at `path` where it was never a checkpoint, damaged or not (a device, a FIFO, a socket,
    an empty file, or one that does not begin as torch.save's files do, such as /etc/passwd); None
    where it may be one (a regular file so begun, a directory, a symbolic link: `load` moves these aside)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return None  # a folder left at the path, or the link itself (never what it names)
    if not stat.S_ISREG(mode):
        return file_kind(mode)
    try:  # O_NONBLOCK: a FIFO swapped in meanwhile never blocks (and is no regular file to read)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            head = fh.read(4) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        head = None
    if head is None:
        return None  # unreadable or swapped meanwhile: read_state says why, as for a damaged checkpoint
    if not head:
        return "an empty file"
    return None if head.startswith(_STATE_FILE_STARTS) else "a file that does not begin as torch.save's files do"


def load(engine) -> tuple[int, list, dict] | None:
    """(round, history, per_round) of the checkpoint, with the server and client states restored;
    None when there is none. A checkpoint that is damaged, of another cell or shards, or
    inconsistent is never believed and never blocks: it is moved aside with a warning and the
    cell starts from round 0. What was never a checkpoint (`never_a_checkpoint`: a device, a
    system file named by mistake) is refused and left alone."""
    path = engine.checkpoint.path
    if path is None or not os.path.lexists(path):
        return None
    never = never_a_checkpoint(path)
    if never:  # e.g. `--checkpoint /etc/passwd`: neither moved aside nor overwritten
        raise ConfigError(f"checkpoint {path} is {never}, never a checkpoint fedrepro writes: refused and left as it "
                          "is; allowed: a path that is absent or holds a checkpoint `fedrepro train` wrote")
    try:
        state = checked(engine, path)
    except CheckpointRejected as exc:
        moved = set_aside(path, str(exc))
        print(f"[fedrepro] warning: checkpoint {path} {exc}; moved aside to {moved.name}, "
              "the cell starts from round 0", file=sys.stderr)
        return None
    engine.method.server = state["server"]
    for c in engine.clients:
        c.state = state["clients"].get(c.id, {})
    return state["round"], state["history"], state["per_round"]


def read_state(path: Path, device: Any, keys: tuple[str, ...] = KEYS, what: str = "checkpoint") -> dict[str, Any]:
    """The dict of `keys` a fedrepro state file (a checkpoint, a final model) holds, read with
    torch.load(weights_only=True), or CheckpointRejected saying why it cannot be believed."""
    if not path.is_file() or path.is_symlink():
        raise CheckpointRejected("is not a regular file")
    return load_state(path, device, keys, what)


def load_state(source: Path | IO[bytes], device: Any, keys: tuple[str, ...] = KEYS, what: str = "checkpoint") -> dict[str, Any]:
    """`read_state` of a path or of a file object already read (a final model's bytes, read bounded)."""
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols: the rejection says enough
            warnings.simplefilter("ignore")
            state = torch.load(source, map_location=device, weights_only=True)
    except pickle.UnpicklingError:  # never repeat torch's advice to load it with weights_only=False
        raise CheckpointRejected("holds objects other than tensors and plain containers (refused by "
                                 "torch.load(weights_only=True))") from None
    except Exception as exc:  # truncated, not a zip archive, unreadable: anything torch cannot load
        detail = (str(exc).splitlines() or [""])[0][:120]
        detail = "" if "weights_only" in str(exc) else f": {detail}"
        raise CheckpointRejected(f"cannot be read ({type(exc).__name__}{detail}); it is truncated or damaged") from None
    if not isinstance(state, dict) or not set(keys) <= set(state):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise CheckpointRejected(f"is not a fedrepro {what} of this version (it has {show(got)})")
    return state


def checked(engine, path: Path) -> dict[str, Any]:
    """The checkpoint's state, or CheckpointRejected saying what is wrong with it."""
    state = read_state(path, engine.device)
    problem = identity_mismatch(state["identity"], engine.checkpoint.identity())
    if problem:
        raise CheckpointRejected(f"belongs to another cell or partition ({problem})")
    done, rounds = state["round"], engine.training["rounds"]
    if not isinstance(done, int) or isinstance(done, bool) or not 1 <= done < rounds:
        raise CheckpointRejected(f"has round {show(done)}; allowed: 1 <= round < {rounds}")
    problem = history_problem(engine, done, state["history"], state["per_round"])
    if problem:
        raise CheckpointRejected(f"is inconsistent after round {done}: {problem}")
    if not isinstance(state["clients"], dict) or not set(state["clients"]) <= {c.id for c in engine.clients}:
        raise CheckpointRejected("has client states of clients this partition does not train")
    return state


def history_problem(engine, done: int, history: Any, per_round: Any) -> str | None:
    """What is wrong with a checkpoint's records after round `done`, or None: `per_round` has one
    entry per round, and `history` one record per evaluated round (training.eval_every) with
    that round's training loss."""
    if not isinstance(per_round, dict) or any(not isinstance(per_round.get(k), list) or len(per_round[k]) != done
                                              for k in ("up", "down", "train_loss")):
        return f"per_round must hold {done} values each of up, down and train_loss"
    evaluated = [r for r in range(1, done + 1) if r % engine.training["eval_every"] == 0]
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return "its history is not a list of records"
    got = [h.get("round") for h in history]
    if got != evaluated:
        return f"its history has the evaluated rounds {show(got)}; expected {show(evaluated)}"
    if any(h.get("train_loss") != per_round["train_loss"][h["round"] - 1] for h in history):
        return "its history's training losses differ from per_round's"
    return None
