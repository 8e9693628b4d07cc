"""Verified downloads and safe archive extraction for `fedrepro prepare`.

Every file a dataset downloads is declared as a `Download` with the checksum published for
it (sha256; md5 + size where only md5 is published). `fetch` downloads into a temporary
folder, verifies the checksum before the file is used or moved into place, and raises
`DownloadVerificationError` naming the file, the expected and the actual checksum on a
mismatch. An archive already present (a leftover or a planted file) is verified the same
way before use; an unpinned one is never reused.

A download without a published checksum is refused (`UnpinnedDownloadError`) unless the
operator opts in with `FEDREPRO_ALLOW_UNPINNED_DOWNLOADS=1` (or `fedrepro prepare
--allow-unpinned`); the sha256 actually downloaded is then recorded in the dataset's
provenance (`results/raw/<dataset>/dataset-<id>.json`, key `downloads`), so a later run can
be compared with it. docs/security.md lists the unpinned files.

`extract_zip` unpacks into a temporary folder beside the destination, refusing absolute
paths, `..` components, symbolic links and archives that expand beyond a size budget; the
caller renames the finished folder into place, so a killed extraction never looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..io import clean_stale, staging_dir
from .base import DataMissingError

ALLOW_UNPINNED_ENV = "FEDREPRO_ALLOW_UNPINNED_DOWNLOADS"
MAX_EXTRACTED_BYTES = 64 << 30  # 64 GiB: DomainNet's largest domain (real) unpacks to ~6 GB
MAX_MEMBERS = 2_000_000


class DownloadVerificationError(DataMissingError):
    """A downloaded (or already present) file does not match its pinned checksum."""


class UnpinnedDownloadError(DataMissingError):
    """A download without a published checksum, and the operator has not opted in."""


class UnsafeArchiveError(DataMissingError):
    """An archive member would land outside the extraction folder, is a link, or the archive is a bomb."""


@dataclass(frozen=True)
class Download:
    """One file a dataset downloads, with the checksum published for it (None: none is published)."""

    filename: str
    url: str
    gdrive_id: str | None = None
    sha256: str | None = None
    md5: str | None = None  # only where no sha256 is published
    size: int | None = None  # bytes, checked with md5
    pin_source: str = ""  # where the checksum comes from

    @property
    def pinned(self) -> bool:
        return bool(self.sha256 or self.md5)


def unpinned_allowed() -> bool:
    return os.environ.get(ALLOW_UNPINNED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_RECORDS: list[list[dict]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """Collect the record of every file fetched inside the block (for the dataset's provenance)."""
    records: list[dict] = []
    _RECORDS.append(records)
    try:
        yield records
    finally:
        _RECORDS.remove(records)


def record(entry: dict) -> None:
    for records in _RECORDS:
        records.append(entry)


def file_digests(path: str | os.PathLike) -> dict:
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            sha.update(block)
            md5.update(block)
            size += len(block)
    return {"sha256": sha.hexdigest(), "md5": md5.hexdigest(), "size": size}


def verify(path: str | os.PathLike, d: Download) -> dict:
    """The file's record {file, url, sha256, size, pinned}; DownloadVerificationError if it differs from the pin."""
    got = file_digests(path)
    checks = [("sha256", d.sha256, got["sha256"]), ("md5", d.md5, got["md5"]), ("size", d.size, got["size"])]
    for kind, expected, actual in checks:
        if expected is not None and str(expected).lower() != str(actual).lower():
            raise DownloadVerificationError(
                f"{path}: {kind} {actual} does not match the pinned {expected} of {d.filename} ({d.url}); the file is "
                "incomplete, corrupted or not the published one. It was not used; delete it and run `fedrepro prepare` again")
    return {"file": d.filename, "url": d.url, "sha256": got["sha256"], "size": got["size"], "pinned": d.pinned,
            **({"pin_source": d.pin_source} if d.pinned else {})}


def require_unpinned_ok(what: str, url: str) -> None:
    """UnpinnedDownloadError unless the operator opted in to downloads without a published checksum."""
    if not unpinned_allowed():
        raise UnpinnedDownloadError(
            f"{what} ({url}) has no published checksum, so fedrepro does not download it by default; to download it "
            f"anyway and record its sha256 in the dataset's provenance, set {ALLOW_UNPINNED_ENV}=1 (or run "
            "`fedrepro prepare --allow-unpinned`), or place the files by hand")


def fetch(d: Download, folder: str | os.PathLike) -> Path:
    """`folder/d.filename`, downloaded and verified (or, if present, verified); returns its path.

    The download goes to a temporary folder beside the destination and is renamed into
    place only once it matches its checksum. Without a checksum, the file is always
    downloaded afresh (never reused) and only with the operator's opt-in."""
    folder = Path(folder)
    dest = folder / d.filename
    if dest.is_file() and d.pinned:
        record(verify(dest, d))
        return dest
    if not d.pinned:
        require_unpinned_ok(d.filename, d.url)
    from torchvision.datasets import utils as tvu  # looked up at call time (tests patch it)

    folder.mkdir(parents=True, exist_ok=True)
    clean_stale(folder)  # downloads of killed jobs
    tmp = staging_dir(folder, d.filename, ".download")
    try:
        if d.gdrive_id:
            tvu.download_file_from_google_drive(d.gdrive_id, str(tmp), d.filename)
        else:
            tvu.download_url(d.url, str(tmp), d.filename)
        got = tmp / d.filename
        if not got.is_file():
            raise DataMissingError(f"downloading {d.url} produced no file {d.filename}")
        entry = verify(got, d)
        os.replace(got, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record(entry)
    return dest


def _member_path(name: str) -> PurePosixPath:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or any(part in ("..", "") for part in p.parts) or (p.parts and ":" in p.parts[0]):
        raise UnsafeArchiveError(f"archive member {name!r} would be written outside the extraction folder; refused")
    return p


def extract_zip(archive: str | os.PathLike, parent: str | os.PathLike, name: str) -> Path:
    """Unpack `archive` into a new temporary folder in `parent` and return it (the caller
    moves what it needs into place and removes the folder). Refuses unsafe members and
    archives expanding to more than MAX_EXTRACTED_BYTES or MAX_MEMBERS members."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(parent)  # extractions of killed jobs
    staging = staging_dir(parent, name, ".extracting")
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_MEMBERS or sum(i.file_size for i in infos) > MAX_EXTRACTED_BYTES:
                raise UnsafeArchiveError(f"{archive}: {len(infos)} members, {sum(i.file_size for i in infos):,} bytes unpacked; "
                                         f"allowed: at most {MAX_MEMBERS:,} members and {MAX_EXTRACTED_BYTES:,} bytes")
            for info in infos:
                rel = _member_path(info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise UnsafeArchiveError(f"{archive}: member {info.filename!r} is a symbolic link; refused")
                target = staging.joinpath(*rel.parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise DataMissingError(f"{archive}: not a valid zip archive ({exc})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def contained(base: str | os.PathLike, rel: str, where: str) -> str:
    """`base/rel` as a string, refusing (DataMissingError) a `rel` that is absolute, has `..`
    or resolves (through symbolic links) outside `base`: a list file names data, never other files."""
    text = rel.replace("\\", "/")
    p = PurePosixPath(text)
    if not text or p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]):
        raise DataMissingError(f"{where}: path {text!r} leaves the data folder {base}; allowed: relative paths inside it")
    full = Path(base).joinpath(*p.parts)
    root = os.path.realpath(base)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise DataMissingError(f"{where}: path {text!r} resolves outside the data folder {base} (a symbolic link?); "
                               "allowed: files inside it")
    return str(full)
