"""Messages that blamed or endangered the wrong thing (issue 46): a file that was never a checkpoint,
named as `fedrepro train --checkpoint` (/etc/passwd, a FIFO), is refused and left alone, not moved
aside, and no message advises deleting it; `fedrepro partition` names an unknown dataset, not the
output folder."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from fedrepro import custody
from fedrepro.cli import main
from fedrepro.registry import ConfigError

PASSWD = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"


def one_line_error(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("[fedrepro] ")]  # progress lines aside
    assert len(errors) == 1 and "Traceback" not in err, err
    return rc, errors[0]


def train_args(tiny_partition, make_cell, tmp_path, checkpoint) -> list[str]:
    return ["train", "--cell", json.dumps(make_cell("local")), "--shards", str(tiny_partition[0]),
            "--out-dir", str(tmp_path / "out"), "--checkpoint", str(checkpoint), "--device", "cpu"]


def test_a_system_file_named_as_checkpoint_is_refused_and_left_alone(tiny_partition, make_cell, tmp_path, capsys):
    """Before: the file was renamed to <name>.rejected-<time> (as root, /etc/passwd itself), then
    written over by the cell's checkpoints and deleted when the cell finished."""
    passwd = tmp_path / "etc" / "passwd"
    passwd.parent.mkdir()
    passwd.write_text(PASSWD)
    rc, err = one_line_error(capsys, train_args(tiny_partition, make_cell, tmp_path, passwd))
    assert rc == 2 and err == (f"fedrepro train: error: checkpoint {passwd} is a file that does not begin as torch.save's "
                               "files do, never a checkpoint fedrepro writes: refused and left as it is; allowed: a path "
                               "that is absent or holds a checkpoint `fedrepro train` wrote")
    assert passwd.read_text() == PASSWD and os.listdir(passwd.parent) == ["passwd"]
    assert not (tmp_path / "out" / "metrics.json").exists()
    empty = tmp_path / "empty"
    empty.touch()
    rc, err = one_line_error(capsys, train_args(tiny_partition, make_cell, tmp_path, empty))
    assert rc == 2 and f"checkpoint {empty} is an empty file, never a checkpoint" in err and empty.exists()


def test_a_fifo_as_checkpoint_is_refused_without_blocking_or_moving_it(tiny_partition, make_cell, tmp_path):
    from fedrepro.engine.run import train_cell

    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"checkpoint {fifo} is a FIFO, never a checkpoint fedrepro writes"):
        train_cell(make_cell("local"), tiny_partition[0], tmp_path / "out", checkpoint=fifo, progress=False)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_damaged_checkpoint_that_cannot_be_moved_aside_is_not_said_to_be_deleted(tiny_partition, make_cell, tmp_path,
                                                                                     monkeypatch):
    """Before: "... cannot be moved aside (Device or resource busy): remove it by hand", also for a
    file that is not fedrepro's (a bind-mounted /etc/hostname of a container, a file in /tmp of another user)."""
    from fedrepro.engine.run import train_cell

    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"PK\x03\x04 truncated")  # begins as a checkpoint does: damaged, so moved aside
    real_replace = os.replace

    def busy(src, dst, *args, **kwargs):
        if os.fspath(src) == str(ckpt):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(custody.os, "replace", busy)
    with pytest.raises(ConfigError) as exc:
        train_cell(make_cell("local"), tiny_partition[0], tmp_path / "out", checkpoint=ckpt, progress=False)
    message = str(exc.value)
    assert message.startswith(f"{ckpt}: cannot be read (") and message.endswith(
        "and it cannot be moved aside (Device or resource busy): it was left as it is and not used; allowed: a path in "
        "a folder where fedrepro may rename files")
    assert "remove" not in message and "delete" not in message and ckpt.read_bytes() == b"PK\x03\x04 truncated"


# ------------------------------------------------------------------ fedrepro partition


@pytest.fixture
def spec(tiny_partition) -> dict:
    from fedrepro.data.shards import read_manifest

    return read_manifest(tiny_partition[0])["spec"]


def test_partition_names_an_unknown_dataset_not_the_output_folder(spec, tmp_path, capsys):
    """Before: "--out ...: the partition directory must be named by the spec's id ..." (the id of
    a spec whose dataset does not exist)."""
    rc, err = one_line_error(capsys, ["partition", "--spec", json.dumps({**spec, "dataset": "nosuch"}), "--root",
                                      str(tmp_path / "raw"), "--out", str(tmp_path / "shards" / "p")])
    assert rc == 2 and err.startswith("fedrepro partition: error: unknown dataset 'nosuch'; allowed: ") and "digits" in err
    rc, err = one_line_error(capsys, ["partition", "--spec", json.dumps({**spec, "dataset_params": {"nosuch": 1}}),
                                      "--root", str(tmp_path / "raw"), "--out", str(tmp_path / "shards" / "p")])
    assert rc == 2 and err == ("fedrepro partition: error: dataset 'digits': unknown parameter(s) ['nosuch']; allowed "
                               "parameters: (none)")
    rc, err = one_line_error(capsys, ["partition", "--spec", json.dumps({**spec, "dataset_params": [1]}),
                                      "--root", str(tmp_path / "raw"), "--out", str(tmp_path / "shards" / "p")])
    assert rc == 2 and err == ("fedrepro partition: error: partition of dataset 'digits': key 'dataset_params' has value "
                               "[1]; allowed: a mapping of the dataset's parameters")
    assert not (tmp_path / "shards").exists()


@pytest.mark.parametrize("bad, named", [
    ({"dataset": "nosuch"}, "has keys ['dataset']; allowed: exactly"),  # before: KeyError 'seed' traceback
    ({"dataset": "nosuch", "dataset_params": {}, "backbone": {"backbone": "vit_tiny_patch16_224", "backbone_args": {}},
      "epochs": 1, "samples": 8, "batch_size": 4, "lr": 0.001, "seed": 0}, "key 'dataset' has value 'nosuch'"),
    ({"dataset": "shifted_domains", "dataset_params": {}, "backbone": {"backbone": "vit_tiny_patch16_224",
      "backbone_args": {}}, "epochs": 0, "samples": 8, "batch_size": 4, "lr": 0.001, "seed": 0}, "epochs"),
])
def test_pretrain_backbone_refuses_a_bad_spec_in_one_line(bad, named, tmp_path, capsys):
    rc, err = one_line_error(capsys, ["pretrain-backbone", "--spec", json.dumps(bad), "--root", str(tmp_path / "raw"),
                                      "--out", str(tmp_path / "b.pt")])
    assert rc == 2 and err.startswith("fedrepro pretrain-backbone: error: argument --spec") and named in err, err
    assert not (tmp_path / "b.pt").exists()
