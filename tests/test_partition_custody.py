"""Chain of custody of a partition: nothing in a partition folder is trusted beyond what the
partition step wrote and hashed (manifest fields, shard paths, which shard is whose), every client
is trainable and scorable unless the config says otherwise, folders honour the umask, and a
killed job's leftovers are cleaned by the next run and never versioned by DVC."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, random_images
from fedrepro.cli import main
from fedrepro.data import shards
from fedrepro.data.downloads import extract_zip
from fedrepro.data.shards import (
    MANIFEST,
    EmptyClientsError,
    PartitionIntegrityError,
    ShardChecksumError,
    load_partition,
    manifest_hash,
    partition_id,
    read_manifest,
    seal_manifest,
    write_partition,
)
from fedrepro.io import TMP_PREFIX, atomic_path, staging_dir


@pytest.fixture
def part(tiny_partition, tmp_path) -> Path:
    """A private copy of the tiny digits partition, to tamper with."""
    out = tmp_path / "shards" / tiny_partition[0].name
    shutil.copytree(tiny_partition[0], out)
    return out


def edit(part: Path, change, reseal: bool = False) -> None:
    """Apply `change` to the manifest on disk; `reseal`: recompute its hashes too (as someone who
    knows the format could), so that only the other checks stand in the way."""
    m = json.loads((part / MANIFEST).read_text())
    change(m)
    (part / MANIFEST).write_text(json.dumps(seal_manifest(m) if reseal else m))


def cli_train(make_cell, part: Path, tmp_path: Path, capsys) -> str:
    """`fedrepro train` on `part`: it must fail with one line (no traceback) and write no metrics."""
    out = tmp_path / "run"
    rc = main(["train", "--cell", json.dumps(make_cell("fedavg")), "--shards", str(part), "--out-dir", str(out), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("fedrepro train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not (out / "metrics.json").exists()
    return lines[0]


def test_manifest_hash_is_recorded_and_covers_every_field(tiny_partition):
    m = read_manifest(tiny_partition[0])
    assert m[shards.MANIFEST_HASH] == manifest_hash(m)
    for key in ("mean", "std", "dtype", "sample_shape", "clients", "files", "unseen_clients", "num_classes"):
        assert manifest_hash({**m, key: "edited"}) != m[shards.MANIFEST_HASH], key


# ------------------------------------------------------------------------- edited manifest fields


EDITS = {
    "mean": lambda m: m.update(mean=[0.9]),
    "std": lambda m: m.update(std=[s * 10 for s in m["std"]]),
    "dtype": lambda m: m.update(dtype="<i2"),
    "clients[1]": lambda m: m["clients"][1].update(unseen=True),
    "clients.length": lambda m: m.update(clients=m["clients"][:-1]),
    "num_classes": lambda m: m.update(num_classes=3),
}


@pytest.mark.parametrize("field", list(EDITS))
def test_an_edited_manifest_field_is_refused_naming_the_file_and_the_field(part, field):
    edit(part, EDITS[field])
    with pytest.raises(PartitionIntegrityError) as exc:
        load_partition(part)
    assert str(part / MANIFEST) in str(exc.value) and f"'{field}'" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_an_edited_manifest_stops_fedrepro_train_with_one_line(part, make_cell, tmp_path, capsys):
    edit(part, EDITS["mean"])
    line = cli_train(make_cell, part, tmp_path, capsys)
    assert f"{part / MANIFEST}: field 'mean' differs" in line and "delete the folder and rerun" in line


def test_a_manifest_without_its_hash_is_refused_with_the_fix(part):
    edit(part, lambda m: (m.pop(shards.MANIFEST_HASH), m.pop(shards.FIELD_HASHES)))
    with pytest.raises(PartitionIntegrityError, match="no field 'manifest_sha256'.*delete the folder and rerun"):
        load_partition(part)


def test_a_resealed_manifest_is_still_held_to_the_fields_shapes(part):
    edit(part, lambda m: m.update(std=[0.0]), reseal=True)
    with pytest.raises(PartitionIntegrityError, match="field 'std' has value"):
        load_partition(part)


# ------------------------------------------------------------------------- foreign shard paths


def _point_client_1_at(path: str):
    def change(m):
        m["files"][path] = m["files"].pop(m["clients"][1]["file"])
        m["clients"][1]["file"] = path
    return change


@pytest.mark.parametrize("where", ["absolute", "dotdot", "subfolder"])
def test_a_shard_path_outside_the_partition_folder_is_refused(part, tmp_path, where):
    outside = tmp_path / "elsewhere.parquet"
    shutil.copy(part / "client_00001.parquet", outside)  # the right bytes: only the path is wrong
    path = {"absolute": str(outside), "dotdot": "../../elsewhere.parquet", "subfolder": "sub/client_00001.parquet"}[where]
    edit(part, _point_client_1_at(path), reseal=True)
    with pytest.raises(PartitionIntegrityError, match="plain file name"):
        load_partition(part)


def test_a_shard_listed_nowhere_in_files_is_refused(part):
    edit(part, lambda m: m["clients"][1].update(file="manifest.json"), reseal=True)
    with pytest.raises(PartitionIntegrityError, match=r"clients\[1\].file"):
        load_partition(part)


def test_a_symbolic_link_out_of_the_partition_is_refused(part, tmp_path):
    outside = tmp_path / "elsewhere.parquet"
    shutil.move(part / "client_00001.parquet", outside)
    (part / "client_00001.parquet").symlink_to(outside)  # same bytes, so the sha256 alone would pass
    with pytest.raises(PartitionIntegrityError, match="symbolic link .* outside the partition folder"):
        load_partition(part)


def test_a_fifo_in_place_of_a_shard_is_refused_without_hanging(part, make_cell, tmp_path, capsys):
    (part / "client_00001.parquet").unlink()
    os.mkfifo(part / "client_00001.parquet")  # opening it to read would block forever; /dev/zero would never end
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the partition hung on a FIFO"))
    signal.alarm(20)
    try:
        with pytest.raises(PartitionIntegrityError, match="not a regular file"):
            load_partition(part)
        assert "client_00001.parquet: not a regular file" in cli_train(make_cell, part, tmp_path, capsys)
    finally:
        signal.alarm(0)


# ------------------------------------------------------------------------- swapped shards


def _swap_shards_0_and_1(part: Path) -> None:
    a, b = part / "client_00000.parquet", part / "client_00001.parquet"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)


def test_swapped_shards_with_swapped_hashes_are_refused(part):
    _swap_shards_0_and_1(part)

    def swap(m):
        f = m["files"]
        f["client_00000.parquet"], f["client_00001.parquet"] = f["client_00001.parquet"], f["client_00000.parquet"]
    edit(part, swap)
    with pytest.raises(PartitionIntegrityError, match="field 'files' differs"):
        load_partition(part)


def test_swapped_shards_are_refused_even_with_a_resealed_manifest(part, make_cell, tmp_path, capsys):
    """Each shard carries its client id: moved to another client's slot it is refused."""
    _swap_shards_0_and_1(part)

    def swap(m):
        f = m["files"]
        f["client_00000.parquet"], f["client_00001.parquet"] = f["client_00001.parquet"], f["client_00000.parquet"]
    edit(part, swap, reseal=True)
    with pytest.raises(PartitionIntegrityError, match="client_id '1', but the manifest reads it as '0'"):
        load_partition(part)
    assert "another client's data" in cli_train(make_cell, part, tmp_path, capsys)


def test_flipped_shard_bytes_still_name_the_shard(part):
    path = part / "client_00002.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardChecksumError, match=f"{path}: sha256"):
        load_partition(part)


# ------------------------------------------------------------------------- empty clients


EMPTY = {"dataset": "random_images", "partitioner": "dirichlet", "num_clients": 40, "seed": 1,
         "params": {"alpha": 0.05, "min_partition_size": 0}}


def test_an_empty_client_is_refused_when_the_partition_is_made(tmp_path):
    with pytest.raises(EmptyClientsError) as exc:
        write_partition(random_images(300), EMPTY, tmp_path / "p")
    msg = str(exc.value)
    assert "dataset 'random_images'" in msg and partition_id(EMPTY) in msg and "clients have no training or no test data" in msg
    assert "min_partition_size" in msg and "allow_empty_clients: true" in msg
    assert not (tmp_path / "p").exists() and not list(tmp_path.iterdir())


def test_empty_clients_are_kept_when_the_config_allows_them(tmp_path):
    spec = {**EMPTY, "allow_empty_clients": True}
    manifest = write_partition(random_images(300), spec, tmp_path / "p")
    assert any(c["sizes"]["test"] == 0 for c in manifest["clients"])
    load_partition(tmp_path / "p")
    # the key enters the spec (and the id) only when set: existing ids are unchanged
    assert partition_id({**EMPTY, "allow_empty_clients": False}) == partition_id(EMPTY) != partition_id(spec)
    assert "allow_empty_clients" not in shards.resolve_partition_spec(EMPTY)


def test_a_partition_with_allowed_empty_clients_trains_and_metrics_show_who_was_scored(tmp_path):
    from conftest import tiny_config
    from fedrepro.config import resolve_experiment
    from fedrepro.data.datasets import load_dataset
    from fedrepro.engine.run import train_cell

    config = tiny_config(rounds=1)
    config["methods"] = {"fedavg": {}}
    config["partitions"]["dir"].update(num_clients=60, allow_empty_clients=True, params={"alpha": 0.05, "min_partition_size": 0})
    exp = resolve_experiment(config)
    part = exp["partitions"][0]
    manifest = write_partition(load_dataset("digits", tmp_path / "raw"), part["spec"], tmp_path / part["id"])
    untestable = [c["id"] for c in manifest["clients"] if not c["sizes"]["test"]]
    assert untestable
    metrics = train_cell(exp["cells"][0], tmp_path / part["id"], tmp_path / "run", device="cpu", progress=False)
    assert metrics["status"] == "ok"
    assert [i for i, n in zip(metrics["clients"]["ids"], metrics["clients"]["test_size"]) if not n] == untestable
    # the summary counts them and every table says how many were left out of the scores
    from fedrepro.report.aggregate import summary_frame
    from fedrepro.report.tables import write_tables

    frame = summary_frame([metrics])
    assert set(frame["unscored_clients"]) == {len(untestable)}
    meta = json.loads(next(p for p in write_tables(frame, tmp_path / "tables") if p.name == "accuracy.meta.json").read_text())
    assert f"left out of every score: digits/dir seed 0: {len(untestable)} of 60" in " ".join(meta["notes"])


def test_fedrepro_partition_reports_empty_clients_in_one_line(tmp_path, capsys):
    spec = {"dataset": "digits", "partitioner": "dirichlet", "num_clients": 300, "seed": 0,
            "params": {"alpha": 0.05, "min_partition_size": 0}}
    out = tmp_path / "shards" / partition_id(spec)
    rc = main(["partition", "--spec", json.dumps(spec), "--root", str(tmp_path / "raw"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.startswith("fedrepro partition: error: dataset 'digits'") and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_validate_refuses_more_clients_than_half_the_samples():
    from conftest import tiny_config
    from fedrepro.config import resolve_experiment
    from fedrepro.registry import ConfigError

    config = tiny_config()
    config["partitions"]["dir"].update(num_clients=1000, params={"alpha": 0.5, "min_partition_size": 0})
    with pytest.raises(ConfigError, match=r"'partitions.dir.num_clients' has value 1000; allowed: at most 898"):
        resolve_experiment(config)
    config["partitions"]["dir"]["allow_empty_clients"] = True
    resolve_experiment(config)


# ------------------------------------------------------------------------- umask, leftovers, DVC


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_partition_folders_and_extracted_archives_honour_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        write_partition(random_images(200), {**EMPTY, "num_clients": 3, "params": {"alpha": 100.0}}, tmp_path / "p")
        archive = tmp_path / "a.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("inner/x.txt", "x")
        extracted = extract_zip(archive, tmp_path / "raw", "a")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "p").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "p" / MANIFEST).stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "p" / "client_00000.parquet").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(extracted.stat().st_mode) == 0o777 & ~mask


KILLED = """
import os, signal, sys
from fedrepro.io import atomic_path, staging_dir
parent = sys.argv[1]
d = staging_dir(parent, "abcdef0123")
open(os.path.join(d, "client_00000.parquet"), "wb").write(b"half")
cm = atomic_path(os.path.join(parent, "dataset-1.json"))
tmp = cm.__enter__()
tmp.write_text("{")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_9_leftover_is_cleaned_by_the_next_run_and_ignored_by_dvc(tmp_path):
    parent = tmp_path / "shards" / "random_images"
    parent.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", KILLED, str(parent)], env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in parent.iterdir())
    assert len(leftovers) == 2 and all(n.startswith(TMP_PREFIX) for n in leftovers), leftovers
    live = staging_dir(parent, "live")  # this process's: alive, so kept
    foreign = parent / f"{TMP_PREFIX}.otherhost.1.abcdef0123.xyz"  # another host's pid means nothing here: kept
    foreign.mkdir()

    spec = {**EMPTY, "num_clients": 3, "params": {"alpha": 100.0}}
    write_partition(random_images(200), spec, parent / partition_id(spec))
    assert sorted(p.name for p in parent.iterdir()) == sorted([partition_id(spec), live.name, foreign.name])

    dvc = REPO / ".venv" / "bin" / "dvc"
    if not dvc.exists():
        dvc = Path(sys.executable).with_name("dvc")
    names = [f"results/shards/random_images/{n}" for n in leftovers + [live.name, "x/.fedrepro-tmp.h.1.m.json.q.tmp",
                                                                      ".abcdef0123.k2j3h4"]]  # an older version's
    out = subprocess.run([str(dvc), "check-ignore", *names], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and sorted(out.stdout.split()) == sorted(names), out.stdout + out.stderr
    kept = ["results/shards/random_images/abcdef0123", "results/shards/random_images/abcdef0123/client_00000.parquet",
            "results/shards/random_images/abcdef0123.png"]
    out = subprocess.run([str(dvc), "check-ignore", *kept], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1 and not out.stdout.strip(), out.stdout  # a partition and its files are versioned


KILLED_WRITER = """
import os, signal, sys
from fedrepro.io import atomic_path
cm = atomic_path(sys.argv[1])
cm.__enter__().write_bytes(b"half a checkpoint")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_training_jobs_temporary_files_are_cleaned_by_the_next_run_of_the_cell(tiny_partition, make_cell, tmp_path):
    """A train job killed while writing (a checkpoint, metrics.json) leaves a temporary file in the
    cell's folders; the cell's next run removes it and writes its results."""
    from fedrepro.engine.run import train_cell

    out, ckpt = tmp_path / "runs" / "cell", tmp_path / "checkpoints" / "cell.pt"
    for target in (out / "metrics.json", ckpt):
        target.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        assert proc.returncode == -signal.SIGKILL
        assert [p.name.startswith(TMP_PREFIX) for p in target.parent.iterdir()] == [True]
    train_cell(make_cell("fedavg", rounds=1), tiny_partition[0], out, checkpoint=ckpt, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["final_model.pt", "metrics.json", "provenance.json"]
    assert list(ckpt.parent.iterdir()) == []


def test_atomic_temporary_names_carry_the_prefix(tmp_path):
    with atomic_path(tmp_path / "f.json") as tmp:
        assert tmp.name.startswith(f"{TMP_PREFIX}.") and f".{os.getpid()}.f.json." in tmp.name
        tmp.write_text("{}")
