"""`mitbih`: MIT-BIH Arrhythmia beats around each annotation, 12 beat classes, `groups["patient"]`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.data.downloads import UnpinnedDownloadError, file_digests, record, require_unpinned_ok
from fedrepro.registry import ConfigError, Param
from fedrepro.data.domains._common import check_name_list, missing_error


MITDB_DIR = "mitdb"
MITDB_FS = 360  # Hz, every MIT-BIH record
#: The 48 records of the MIT-BIH Arrhythmia Database (PhysioNet mitdb 1.0.0).
MITDB_RECORDS = (
    "100 101 102 103 104 105 106 107 108 109 111 112 113 114 115 116 117 118 119 121 122 123 124 "
    "200 201 202 203 205 207 208 209 210 212 213 214 215 217 219 220 221 222 223 228 230 231 232 233 234"
).split()
#: PhysioNet beat annotation codes (https://archive.physionet.org/physiobank/annotations.shtml);
#: every other code ('+', '~', '|', '!', 'x', '[', ']', '"', ...) marks no beat and is dropped.
BEAT_SYMBOLS = ("N", "L", "R", "B", "A", "a", "J", "S", "V", "r", "F", "e", "j", "n", "E", "/", "f", "Q", "?")
#: GRP-FED's 12 arrhythmia classes (shared/papers/grp-fed.txt: "one of 12 arrhythmia classes"; the
#: symbols are not listed there). [RECON] the 12 most frequent beat types of mitdb, class id = position
#: (mitdb counts): N normal 75,052; L left bundle branch block 8,075; R right bundle branch block 7,259;
#: V premature ventricular contraction 7,130; / paced 7,028; A atrial premature 2,546; f fusion of paced
#: and normal 982; F fusion of ventricular and normal 803; j nodal (junctional) escape 229; a aberrated
#: atrial premature 150; E ventricular escape 106; J nodal (junctional) premature 83. Dropped beats:
#: Q unclassifiable 33, e atrial escape 16, S supraventricular premature 2 (and B, r, n, ? absent in mitdb).
MITBIH_CLASSES = ("N", "L", "R", "V", "/", "A", "f", "F", "j", "a", "E", "J")
MITBIH_SOURCE = (
    "MIT-BIH Arrhythmia Database (Moody & Mark 2001; PhysioNet, Goldberger et al. 2000), "
    "https://physionet.org/content/mitdb/1.0.0/ via wfdb.dl_database('mitdb')"
)


def _mitdb_present(d: Path) -> list[str]:
    """Records with .hea, .dat and .atr, numerically sorted."""
    if not d.is_dir():
        return []
    recs = [p.stem for p in d.glob("*.hea") if (d / f"{p.stem}.dat").is_file() and (d / f"{p.stem}.atr").is_file()]
    return sorted(recs, key=lambda r: (int(r) if r.isdigit() else 10**9, r))


def _mitbih_records_param(params: dict) -> list[str] | None:
    recs = params["records"]
    if recs is None:
        return None
    out = [str(r) for r in recs]
    if not out or len(set(out)) != len(out):
        raise ConfigError(f"dataset 'mitbih': key 'records' has value {recs!r}; allowed: None or a non-empty list of distinct record names")
    return out


def _mitbih_how() -> list[str]:
    return [
        "run `fedrepro prepare` with internet access: it calls wfdb.dl_database('mitdb', <folder above>), or",
        "download https://physionet.org/static/published-projects/mitdb/mit-bih-arrhythmia-database-1.0.0.zip and put "
        "each record's .hea, .dat and .atr files directly into the folder above",
    ]


def _mitbih_missing_error(d: Path, wanted: Sequence[str], detail: str = "") -> DataMissingError:
    missing = [r for r in wanted if not all((d / f"{r}.{e}").is_file() for e in ("hea", "dat", "atr"))]
    return missing_error(
        "MIT-BIH record files are",
        d,
        [f"{r}.hea, {r}.dat, {r}.atr" for r in missing] or [f"<record>.hea/.dat/.atr for records {', '.join(wanted)}"],
        _mitbih_how(),
        detail,
    )


def _prepare_mitbih(root: Path, params: dict) -> None:
    d = Path(root) / MITDB_DIR
    wanted = _mitbih_records_param(params) or list(MITDB_RECORDS)
    present = set(_mitdb_present(d))
    missing = [r for r in wanted if r not in present]
    if not missing:
        return
    try:
        # PhysioNet publishes no per-file checksum that wfdb checks: an unpinned download (opt-in).
        require_unpinned_ok(f"MIT-BIH records {', '.join(missing)}", "https://physionet.org/content/mitdb/1.0.0/")
    except UnpinnedDownloadError as exc:
        raise DataMissingError(f"{exc}\n{_mitbih_missing_error(d, wanted)}") from None
    try:
        import wfdb

        d.mkdir(parents=True, exist_ok=True)
        wfdb.dl_database("mitdb", dl_dir=str(d), records=missing, annotators=["atr"])
    except Exception as exc:
        raise _mitbih_missing_error(d, wanted, f"{type(exc).__name__}: {exc}") from None
    for r in missing:
        for ext in ("hea", "dat", "atr"):
            if (d / f"{r}.{ext}").is_file():
                got = file_digests(d / f"{r}.{ext}")
                record({"file": f"{MITDB_DIR}/{r}.{ext}", "url": "https://physionet.org/files/mitdb/1.0.0/",
                        "sha256": got["sha256"], "size": got["size"], "pinned": False})
    if any(r not in set(_mitdb_present(d)) for r in wanted):
        raise _mitbih_missing_error(d, wanted)


def _load_mitbih(root: Path, params: dict) -> RawDataset:
    d = Path(root) / MITDB_DIR
    requested = _mitbih_records_param(params)
    classes = check_name_list("dataset 'mitbih'", "classes", params["classes"], BEAT_SYMBOLS)
    window, lead, normalize = int(params["window"]), str(params["lead"]), params["normalize"]
    present = _mitdb_present(d)
    if requested is None:
        if not present:
            raise _mitbih_missing_error(d, MITDB_RECORDS)
        records = present
    else:
        if any(r not in present for r in requested):
            raise _mitbih_missing_error(d, requested)
        records = requested

    import wfdb

    pre = window // 2  # the R-peak sits at index window // 2: samples [r - window//2, r - window//2 + window)
    cls_id = {s: i for i, s in enumerate(classes)}
    xs, ys, patients, record_ids, used, skipped = [], [], [], [], [], []
    for rec in records:
        path = str(d / rec)
        header = wfdb.rdheader(path)
        if lead not in (header.sig_name or []):
            if requested is not None:
                raise ConfigError(f"dataset 'mitbih': record {rec} has no {lead!r} signal (it has {header.sig_name}); drop it from 'records'")
            skipped.append(rec)
            continue
        sig = wfdb.rdrecord(path, channel_names=[lead]).p_signal[:, 0].astype(np.float32)
        ann = wfdb.rdann(path, "atr")
        samples = np.asarray(ann.sample, dtype=np.int64)
        symbols = np.asarray(ann.symbol, dtype=object)
        keep = np.isin(symbols, classes) & (samples - pre >= 0) & (samples - pre + window <= len(sig))
        starts = samples[keep] - pre
        beats = sig[starts[:, None] + np.arange(window)[None, :]] if len(starts) else np.empty((0, window), np.float32)
        xs.append(beats)
        ys.append(np.asarray([cls_id[s] for s in symbols[keep]], dtype=np.int64))
        patients.append(np.full(len(starts), len(used), dtype=np.int64))
        record_ids.append(np.full(len(starts), int(rec) if rec.isdigit() else -1, dtype=np.int64))
        used.append(rec)
    if not used:
        raise DataMissingError(f"MIT-BIH: none of the records in {d} has a {lead!r} signal (skipped: {skipped})")
    x = np.concatenate(xs)[:, None, :].astype(np.float32)
    if normalize == "beat":
        mu = x.mean(axis=2, keepdims=True)
        sd = x.std(axis=2, keepdims=True)
        x = ((x - mu) / np.maximum(sd, 1e-6)).astype(np.float32)
    y = np.concatenate(ys)
    note = f"; records without {lead} skipped: {', '.join(skipped)}" if skipped else ""
    return RawDataset(
        name="mitbih",
        x=np.ascontiguousarray(x),
        y=y,
        num_classes=len(classes),
        official_split=np.zeros(len(y), dtype=np.int8),  # no official split; GRP-FED splits 80/20 per patient
        mean=(float(x.mean()),) if len(y) else (0.0,),
        std=(float(x.std()) or 1.0,) if len(y) else (1.0,),
        source=f"{MITBIH_SOURCE} [lead {lead}, window {window} samples, classes {''.join(classes)}, "
        f"{len(used)} patients{note}]",
        groups={"patient": np.concatenate(patients), "record": np.concatenate(record_ids)},
    )


register_dataset(
    DatasetSpec(
        name="mitbih",
        summary="MIT-BIH Arrhythmia: R-peak-centred ECG beat windows (360 Hz), 12 beat classes, patient id per beat",
        source=MITBIH_SOURCE,
        num_classes=len(MITBIH_CLASSES),
        sample_shape=(1, 256),
        size="~109k annotated beats in 48 records (47 subjects); default: 46 records with an MLII lead",
        params={
            "window": Param(256, "beat window length in samples at 360 Hz (256 = 0.71 s), R-peak at index window // 2", int, minimum=8),
            "lead": Param(
                "MLII",
                "signal to read; records without it are skipped (with MLII: 102 and 104, leaving 46 patients as in GRP-FED)",
                str,
            ),
            "classes": Param(
                list(MITBIH_CLASSES),
                "beat annotation symbols kept, class id = position; other beats and all non-beat annotations are dropped",
                (list, tuple),
            ),
            "records": Param(None, "record names to read (e.g. ['100', '101']); None = every record present", (list, tuple, type(None))),
            "normalize": Param(
                "none",
                "'none': raw millivolts (normalised later by the dataset mean/std); 'beat': z-score each window",
                str,
                choices=("none", "beat"),
            ),
        },
        prepare=_prepare_mitbih,
        load=_load_mitbih,
    )
)
