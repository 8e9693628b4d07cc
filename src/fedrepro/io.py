"""Atomic file writes, checksums, canonical hashing and seed derivation."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only on success.

    A crash or an exception leaves `path` untouched (old content or absent), never
    half-written. The rename is atomic on POSIX file systems.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide results from collaborators
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if exc.errno == errno.ENOSPC:  # name the file: the bare errno does not
            raise OSError(exc.errno, f"No space left on device: cannot write {path} (nothing was written)") from exc
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as fh:
        return json.load(fh)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def short_hash(obj: Any, length: int = 10) -> str:
    """Content address of a JSON-able object (stable across runs and machines)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that depends only on (seed, keys): independent streams per purpose.

    Using derived seeds instead of one running stream makes every round and client
    reproducible on its own, which is what makes resume-from-checkpoint exact.
    """
    ints = [int(seed)] + [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    state = np.random.SeedSequence(ints).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)
