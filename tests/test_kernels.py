"""The CPU kernel cap (issue 56, fedrepro/kernels.py): every fedrepro process runs torch's CPU
kernels at one named instruction level, records it in provenance.json, and `fedrepro verify` names a
level difference instead of reporting a bare mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedrepro  # noqa: F401  (applies the cap)
from fedrepro import kernels
from fedrepro.cli import main
from fedrepro.config import load_and_resolve
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import write_partition

REPO = Path(__file__).resolve().parents[1]


def _env(level: str) -> dict:
    return dict(os.environ) | {kernels.ENV: level}  # the suite's capped variables inherited, as a job inherits them


def _native_capability() -> str:
    """What torch picks on this CPU with no cap, in a fresh process."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {k: v for k, v in os.environ.items() if k not in kernels.VARIABLES}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_fedrepro_caps_the_kernels_at_avx2_by_default():
    assert os.environ.get(kernels.ENV, "avx2") == "avx2"  # the suite runs at the default
    assert [os.environ[v] for v in kernels.VARIABLES] == ["avx2", "AVX2", "AVX2"]
    assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")  # never AVX512 while capped
    assert kernels.in_force()["requested"] == "avx2"


def test_a_capped_level_overrides_variables_set_by_hand():
    code = "import fedrepro, os, torch; print(os.environ['ATEN_CPU_CAPABILITY'], torch.backends.cpu.get_cpu_capability())"
    env = _env("avx2") | {"ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "avx2" and out[1] != "AVX512"


@pytest.fixture(scope="module")
def cell_and_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("project") / "results"
    _, exp = load_and_resolve([REPO / "config" / "test.yaml"], sets=["training.rounds=1"])
    cell = next(c for c in exp["cells"] if (c["partition"], c["label"], c["seed"]) == ("dir0.5", "fedavg", 0))
    shards = root / "shards" / "digits" / cell["partition_id"]
    spec = next(p["spec"] for p in exp["partitions"] if p["id"] == cell["partition_id"])
    write_partition(load_dataset("digits", tmp_path_factory.mktemp("raw")), spec, shards)
    return root, cell, shards


def _train(level: str, root: Path, cell: dict, shards: Path) -> subprocess.CompletedProcess:
    out = root / "test" / "runs" / "digits" / "dir0.5" / "fedavg" / "seed0"
    return subprocess.run([sys.executable, "-m", "fedrepro", "train", "--cell", json.dumps(cell), "--shards", str(shards),
                           "--out-dir", str(out), "--threads", "1"], env=_env(level), capture_output=True, text=True)


def test_uncapped_and_capped_cells_record_their_levels_and_verify_names_the_difference(cell_and_shards, capsys):
    root, cell, shards = cell_and_shards
    native = _native_capability()
    assert _train("native", root, cell, shards).returncode == 0
    prov = json.loads((root / "test/runs/digits/dir0.5/fedavg/seed0/provenance.json").read_text())
    assert prov["kernels"]["requested"] == "native" and prov["kernels"]["capability"] == native
    assert prov["kernels"]["cpu"]
    here = torch.backends.cpu.get_cpu_capability()
    assert main(["verify", str(root / "test")]) in (0, 1)
    out = capsys.readouterr().out
    note = f"recorded under another kernel level ({native}, here {here})"
    assert (note in out) == (native != here), out  # on an AVX-512 CPU: named

    assert _train("avx2", root, cell, shards).returncode == 0
    prov = json.loads((root / "test/runs/digits/dir0.5/fedavg/seed0/provenance.json").read_text())
    assert prov["kernels"]["requested"] == "avx2" and prov["kernels"]["capability"] == here
    assert prov["kernels"]["onednn_max_cpu_isa"] == "AVX2" and prov["kernels"]["mkl_enable_instructions"] == "AVX2"
    assert main(["verify", str(root / "test")]) == 0  # the same level: exact, and no level note
    out = capsys.readouterr().out
    assert "kernel level" not in out and out.rstrip().endswith("1 of 1 cell(s) exact, 0 differ, 0 cannot be reproduced here")

    # a recorded level that differs (what an AVX-512 run looks like on any machine) is named
    path = root / "test/runs/digits/dir0.5/fedavg/seed0/provenance.json"
    prov["kernels"]["capability"] = "AVX512" if here != "AVX512" else "AVX2"
    path.write_text(json.dumps(prov))
    main(["verify", str(root / "test")])
    assert f"recorded under another kernel level ({prov['kernels']['capability']}, here {here})" in capsys.readouterr().out


def test_a_bad_level_is_refused_in_one_line_before_training(cell_and_shards):
    root, cell, shards = cell_and_shards
    proc = _train("avx9000", root, cell, shards)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "FEDREPRO_KERNELS has value 'avx9000'; allowed: avx2, avx512, native" in proc.stderr
