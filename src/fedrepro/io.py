"""Atomic file writes, checksums, canonical hashing and seed derivation."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np


def current_umask() -> int:
    """The process's umask now (read from /proc where it can be, since os.umask can only be read by
    setting it, which for a moment would give other threads' files no mask at all)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


# Every temporary name fedrepro creates starts with TMP_PREFIX, then the host and the pid of
# its creator: a job killed with SIGKILL leaves such names behind, and `clean_stale` (run by
# the next partition / download / extraction in that folder, and by a cell's next training job
# in its run and checkpoint folders) removes those whose creator is
# certainly dead; .dvcignore keeps DVC from versioning them meanwhile.
TMP_PREFIX = ".fedrepro-tmp"
_TMP_NAME = re.compile(rf"^{re.escape(TMP_PREFIX)}\.([A-Za-z0-9-]+)\.(\d+)\.")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "localhost"


def tmp_prefix(name: str) -> str:
    """The prefix of a temporary name beside `name` (its own name shortened: NAME_MAX is 255)."""
    return f"{TMP_PREFIX}.{_host()}.{os.getpid()}.{name[:100]}."


def staging_dir(parent: str | os.PathLike, name: str, suffix: str = "") -> Path:
    """A new, uniquely named folder in `parent` to build `name` in before it is renamed into
    place; its mode follows the umask (mkdtemp's 0700 would hide the result from collaborators)."""
    path = Path(tempfile.mkdtemp(prefix=tmp_prefix(name), suffix=suffix, dir=parent))
    os.chmod(path, 0o777 & ~current_umask())
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user's process
        return True
    return True


def clean_stale(folder: str | os.PathLike) -> list[str]:
    """Remove the temporary files and folders in `folder` left by fedrepro processes of this host
    that are dead (killed before they could clean up); return their names. Names of live
    processes, of other hosts (their pids mean nothing here) and anything else are left alone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    host = _host()
    for entry in entries:
        m = _TMP_NAME.match(entry.name)
        if not m or m.group(1) != host or _pid_alive(int(m.group(2))):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        removed.append(entry.name)
    return removed


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for messages ("a FIFO", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


class NotRegularFile(OSError):
    """read_regular: the path is a directory, FIFO, device or socket (its `st_mode` is kept)."""

    def __init__(self, path: str | os.PathLike, mode: int):
        what = f"{file_kind(mode)}, not a regular file"
        super().__init__(f"{path}: {what}")
        self.filename, self.st_mode, self.strerror = str(path), mode, what

    def __str__(self) -> str:  # OSError's own would read "[Errno None] None: <path>" (no errno)
        return str(self.args[0])


class FileTooLarge(OSError):
    """read_regular: the file holds more than `limit` bytes (`size` as fstat saw it, or more)."""

    def __init__(self, path: str | os.PathLike, size: int, limit: int):
        what = f"{size:,} bytes; allowed: at most {limit:,}"
        super().__init__(f"{path}: {what}")
        self.filename, self.size, self.limit, self.strerror = str(path), size, limit, what

    def __str__(self) -> str:
        return str(self.args[0])


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them. Opened without blocking and
    checked with fstat before one byte is read: a FIFO, device or socket named (or swapped in after
    a check) never hangs or floods the reader (NotRegularFile); a larger file is FileTooLarge.
    A missing or unreadable path raises the OSError of os.open, for the caller to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:  # fstat before fdopen: fdopen itself refuses a directory, with a message naming the fd number
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(path, st.st_mode)
    with os.fdopen(fd, "rb") as fh:
        if limit is not None and st.st_size > limit:
            raise FileTooLarge(path, st.st_size, limit)
        data = fh.read() if limit is None else fh.read(limit + 1)  # + 1: a file that grew since fstat
    if limit is not None and len(data) > limit:
        raise FileTooLarge(path, len(data), limit)
    return data


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only on success.

    A crash or an exception leaves `path` untouched (old content or absent), never
    half-written. The rename is atomic on POSIX file systems; the file and then its
    directory are fsync-ed, so after a power loss the new content is there or the old one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~current_umask())  # mkstemp's 0600 would hide results from collaborators
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if _disk_full(exc, path.parent):  # name the file: the bare errno does not
            raise OSError(errno.ENOSPC, f"No space left on device: cannot write {path} (nothing was written)") from exc
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


#: how torch's own file writer (torch.save to a path) reports a failed write: without the errno
_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed writing")


def _disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether `exc`, raised while writing into `folder`, is a full disk: OSError ENOSPC, also where
    torch's RuntimeError for the failed write replaced it (it keeps it as its context), or torch's
    RuntimeError alone on a file system that has (almost) no space left."""
    seen, cause = 0, exc
    while cause is not None and seen < 8:  # the chain torch's writer leaves: RuntimeError from OSError
        if isinstance(cause, OSError):
            return cause.errno == errno.ENOSPC
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if not any(s in str(exc) for s in _TORCH_WRITE_FAILURES):
        return False
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, making the renames and creations inside it durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _renameat2_exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False  # kernel or file system without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), a)


def replace_dir(new: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put the finished directory `new` at `dest`, replacing what is there without a moment in
    which `dest` is missing (atomic exchange, then the old content is removed); where the
    exchange is not supported, the old directory is renamed away just before the new one is
    renamed in (a gap of two renames, never a half-written directory)."""
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.replace(new, dest)
    elif _renameat2_exchange(str(new), str(dest)):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old content
    else:
        trash = Path(tempfile.mkdtemp(prefix=tmp_prefix(f"{dest.name}.old"), dir=dest.parent))
        os.replace(dest, trash / dest.name)
        os.replace(new, dest)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(dest.parent)


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


#: Nesting allowed in a JSON file fedrepro reads (its own files nest < 10 levels). Deeper documents
#: are refused before parsing: the parser and the code walking the result recurse per level.
MAX_JSON_DEPTH = 64
#: Largest JSON file `read_json` reads by default (selection records: KBs).
MAX_JSON_BYTES = 16 << 20
# a string, or an unterminated one up to the end (never retried from inside it: linear, not quadratic)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_JSON_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_JSON_TOKEN = re.compile(rf"{_JSON_STRING.pattern}|[\[\]{{}}]", re.S)


def _json_too_deep(text: str, max_depth: int) -> int | None:
    """The offset of the first '[' or '{' in `text` nested deeper than `max_depth`, else None.
    Without recursion and in C loops (regex, numpy): strings are dropped (they may hold brackets),
    then the running depth of the brackets left is summed in chunks."""
    brackets = _JSON_NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    depth, chunk = 0, 1 << 20
    for start in range(0, len(brackets), chunk):
        b = np.frombuffer(brackets, np.uint8, count=min(chunk, len(brackets) - start), offset=start)
        level = np.cumsum(np.where((b == ord("[")) | (b == ord("{")), 1, -1), dtype=np.int64) + depth
        over = np.flatnonzero(level > max_depth)
        if over.size:  # rare: find where in `text` that bracket is
            k = start + int(over[0])
            tokens = (m for m in _JSON_TOKEN.finditer(text) if m.group()[0] != '"')
            return next(m for i, m in enumerate(tokens) if i == k).start()
        depth = int(level[-1])
    return None


def load_json(data: str | bytes, max_depth: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """json.loads(data, **kwargs) for every JSON fedrepro reads: `data` (bytes: UTF-8) nested deeper
    than `max_depth` is refused before it is parsed, as a json.JSONDecodeError at the bracket (so
    every caller's handling of invalid JSON words it; a 200,000-level document would otherwise raise
    RecursionError in the parser or in code walking the result)."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    pos = _json_too_deep(text, max_depth)
    if pos is not None:
        raise json.JSONDecodeError(f"nested more than {max_depth} levels deep; allowed: at most {max_depth}", text, pos)
    try:
        return json.loads(text, **kwargs)
    except RecursionError:  # only where the caller's own stack is already nearly full
        raise json.JSONDecodeError("nested too deeply to parse here", text, 0) from None


def read_json(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON in the regular file `path` (at most `limit` bytes, read_regular; nesting bounded,
    load_json). Invalid or too deep JSON is a json.JSONDecodeError whose message names the file;
    the OSErrors are read_regular's (NotRegularFile, FileTooLarge, FileNotFoundError)."""
    data = read_regular(path, limit)
    try:
        return load_json(data)
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"{path}: not UTF-8 text (byte {exc.start})", "", 0) from None
    except json.JSONDecodeError as exc:
        raise json.JSONDecodeError(f"{path}: {exc.msg}", exc.doc, exc.pos) from None


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
