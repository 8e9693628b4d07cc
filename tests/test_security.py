"""Hostile and malformed input (issue 15): nothing a config or a dataset file contains is ever
executed, names stay inside their folders, downloads are verified, archives and list files stay
inside the data folder, and replacements are atomic. docs/security.md describes the mechanisms.

The malformed configs themselves (with their exact messages) are tests/test_config.py's BAD list,
checked end to end by tests/test_bad_configs.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import fedrepro.data.domains as dom
from fedrepro.cli import main as fedrepro_main
from fedrepro.config import load_config, load_experiment, resolve_experiment
from fedrepro.configfile import MAX_VALUES, check_plain, parse_config_text
from fedrepro.data import downloads as dl
from fedrepro.data.base import DataMissingError
from fedrepro.data.datasets import load_dataset, prepare_dataset
from fedrepro.io import atomic_path, replace_dir
from fedrepro.registry import ALLOW_LARGE_ENV, ConfigError, show

from conftest import REPO

TEST_CONFIG = REPO / "config" / "test.yaml"


def yte_config(marker: Path) -> str:
    """config/test.yaml turned into a YTE template whose evaluation creates `marker`."""
    text = TEST_CONFIG.read_text()
    payload = f"?__import__('pathlib').Path({str(marker)!r}).write_text('x') and 'test'"
    return ("__use_yte__: true\n__definitions__:\n  - import pathlib\n"
            f"  - pathlib.Path({str(marker) + '.def'!r}).write_text('x')\n" + text.replace("experiment: test", f"experiment: {payload}"))


def run_snakemake(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path / "wd"),
                           "-n", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------ YTE: never evaluated


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["workflow/profiles/local", "workflow/profiles/slurm", None],
                         ids=["local-profile", "slurm-profile", "default-profile"])
def test_snakemake_dry_run_refuses_a_yte_config_without_running_it(tmp_path, profile):
    marker = tmp_path / "MARKER"
    (tmp_path / "yte.yaml").write_text(yte_config(marker))
    args = ["--configfile", "yte.yaml"] + (["--workflow-profile", str(REPO / profile)] if profile else [])
    proc = run_snakemake(tmp_path, *args)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "fedrepro: invalid experiment config: config key '__use_yte__' has value True" in text, text[-3000:]
    assert not marker.exists() and not Path(str(marker) + ".def").exists(), "the YTE config was executed"
    assert "Traceback" not in text and "Building DAG" not in text


@pytest.mark.slow
def test_without_any_workflow_profile_snakemake_itself_evaluates_yte(tmp_path):
    """The residual risk docs/security.md states: `--workflow-profile none` skips fedrepro's guard,
    and Snakemake evaluates the template before the Snakefile runs (the Snakefile still refuses
    the config afterwards). This keeps the payload above honest: it is live."""
    marker = tmp_path / "MARKER"
    (tmp_path / "yte.yaml").write_text(yte_config(marker))
    proc = run_snakemake(tmp_path, "--configfile", "yte.yaml", "--workflow-profile", "none")
    assert proc.returncode != 0
    assert marker.exists(), "Snakemake no longer evaluates YTE in --configfile: update docs/security.md"


def test_fedrepro_validate_refuses_a_yte_config_without_running_it(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    (tmp_path / "yte.yaml").write_text(yte_config(marker))
    assert fedrepro_main(["validate", str(tmp_path / "yte.yaml")]) == 2
    assert "config key '__use_yte__' has value True" in capsys.readouterr().err
    assert not marker.exists() and not Path(str(marker) + ".def").exists()


def test_guard_replaces_snakemakes_config_reader(tmp_path):
    import snakemake.common.configfile as cf
    import snakemake.settings.types as st

    from fedrepro import snakemake_guard

    saved = cf.load_configfile, st.load_configfile
    try:
        snakemake_guard.install()
        assert snakemake_guard.installed()
        marker = tmp_path / "MARKER"
        (tmp_path / "yte.yaml").write_text(yte_config(marker))
        with pytest.raises(SystemExit) as exc:
            st.load_configfile(tmp_path / "yte.yaml")
        assert str(exc.value).startswith("fedrepro: invalid experiment config: config key '__use_yte__'")
        assert not marker.exists()
        assert st.load_configfile(TEST_CONFIG) == load_config(TEST_CONFIG)
    finally:
        cf.load_configfile, st.load_configfile = saved


def test_profiles_keep_their_settings_when_rendered_with_the_guard():
    import snakemake.common.configfile as cf
    import snakemake.settings.types as st
    from snakemake.cli import parse_args

    saved = cf.load_configfile, st.load_configfile
    try:
        local = parse_args(["-s", str(REPO / "Snakefile"), "-n", "--workflow-profile", str(REPO / "workflow/profiles/local")])[1]
        slurm = parse_args(["-s", str(REPO / "Snakefile"), "-n", "--workflow-profile", str(REPO / "workflow/profiles/slurm")])[1]
        from fedrepro.snakemake_guard import installed

        assert installed()
    finally:
        cf.load_configfile, st.load_configfile = saved
    assert isinstance(local.cores, int) and local.cores >= 1 and local.keep_going and local.rerun_incomplete and local.show_failed_logs
    assert slurm.executor == "slurm" and slurm.jobs == 100 and slurm.retries == 2 and slurm.latency_wait == 60


def test_every_profile_installs_the_guard():
    for path in [REPO / "profiles/default/config.yaml", *sorted((REPO / "workflow/profiles").glob("*/config.yaml"))]:
        text = path.read_text()
        assert "__use_yte__: true" in text and "from fedrepro.snakemake_guard import install" in text, path


# ------------------------------------------------------------- the strict reader and checks


def test_yaml_python_tags_never_construct_objects(tmp_path):
    marker = tmp_path / "MARKER"
    for text in (f"experiment: !!python/object/apply:os.system ['touch {marker}']\n",
                 f"x: !!python/object/new:os.system ['touch {marker}']\n", "x: !!python/name:os.system\n"):
        with pytest.raises(ConfigError, match="tag"):
            parse_config_text(text)
    assert not marker.exists()


def test_dicts_from_elsewhere_get_the_same_value_checks():
    """What Snakemake (or a caller) built as a dict: shared-reference bombs, non-string keys,
    cycles and NaN are refused by resolve_experiment itself, in well under a second."""
    bomb: list = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    base = load_config(TEST_CONFIG)
    with pytest.raises(ConfigError, match=f"more than {MAX_VALUES:,} values"):
        resolve_experiment({**base, "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": bomb}}}}})
    with pytest.raises(ConfigError, match="key True of type bool"):
        resolve_experiment({**base, "partitions": {True: {"partitioner": "iid", "num_clients": 2}}})
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(ConfigError, match="contains itself"):
        check_plain({"x": cyclic})
    with pytest.raises(ConfigError, match="nan"):
        resolve_experiment({**base, "training": {"rounds": 3, "optimizer": {"lr": float("nan")}}})


def test_error_messages_truncate_values():
    bomb: list = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    assert len(show(bomb)) < 1000 and len(show("x" * 10**6)) < 100
    with pytest.raises(ConfigError) as exc:
        from fedrepro.registry import Param

        Param(1, type=int).check("where", "key", bomb)
    assert len(str(exc.value)) < 1200


def test_missing_and_binary_config_files_are_messages_not_tracebacks(tmp_path, capsys):
    assert fedrepro_main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "not found; allowed" in capsys.readouterr().err
    (tmp_path / "bin.yaml").write_bytes(b"\x00\xff\xfe" * 10)
    assert fedrepro_main(["validate", str(tmp_path / "bin.yaml")]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    (tmp_path / "big.yaml").write_bytes(b"# " + b"x" * (2 << 20))
    assert fedrepro_main(["cells", str(tmp_path / "big.yaml")]) == 2
    assert "larger than" in capsys.readouterr().err


def test_yaml_merge_keys_and_a_few_aliases_stay_allowed():
    cfg = parse_config_text("a: &base {x: 1, y: 2}\nb: {<<: *base, y: 3}\nc: [*base, *base]\n")
    assert cfg["b"] == {"x": 1, "y": 3} and cfg["c"] == [{"x": 1, "y": 2}] * 2


def test_every_shipped_config_validates_within_the_budgets(monkeypatch):
    monkeypatch.delenv(ALLOW_LARGE_ENV, raising=False)
    paths = sorted([*(REPO / "config").glob("*.yaml"), *(REPO / "config" / "experiments").glob("*.yaml"),
                    *(REPO / "config" / "papers").glob("*.yaml")])
    assert len(paths) >= 10
    for path in paths:
        assert resolve_experiment(load_config(path))["cells"], path


def test_budgets_are_lifted_by_the_environment_or_the_flag(tmp_path, monkeypatch, capsys):
    cfg = load_config(TEST_CONFIG)
    cfg["training"]["rounds"] = 20_000
    monkeypatch.delenv(ALLOW_LARGE_ENV, raising=False)
    with pytest.raises(ConfigError, match="sanity bound"):
        resolve_experiment(cfg)
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(cfg))
    assert fedrepro_main(["validate", str(tmp_path / "big.yaml")]) == 2
    assert fedrepro_main(["validate", "--allow-large-budgets", str(tmp_path / "big.yaml")]) == 0
    monkeypatch.setenv(ALLOW_LARGE_ENV, "1")
    assert resolve_experiment(cfg)["cells"][0]["training"]["rounds"] == 20_000


def test_load_experiment_merges_files_and_overrides_like_snakemake(tmp_path):
    (tmp_path / "extra.yaml").write_text("training: {rounds: 5}\n")
    cfg = load_experiment([TEST_CONFIG, tmp_path / "extra.yaml"], {"seeds": [3]})
    assert cfg["training"]["rounds"] == 5 and cfg["training"]["batch_size"] == 16 and cfg["seeds"] == [3]
    with pytest.raises(ConfigError, match="nan"):
        load_experiment([TEST_CONFIG], {"training": {"rounds": float("nan")}})


# -------------------------------------------------------------- the workflow's paths and shells


def test_every_path_in_every_shell_command_is_quoted():
    placeholder = re.compile(r"\{(input|output|log|params|wildcards)(\.[A-Za-z_]+)?(:[a-z]+)?\}")
    checked = 0
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        lines = smk.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "shell:":
                continue
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                for m in placeholder.finditer(lines[j]):
                    assert m.group(3) == ":q", f"{smk.name}:{j + 1}: {m.group(0)} is not quoted (:q)"
                    checked += 1
                j += 1
    assert checked >= 20


def test_every_wildcard_is_constrained():
    constrained = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for block in smk.read_text().split("wildcard_constraints:")[1:]:
            constrained |= set(re.findall(r"^\s+(\w+)=", block.split("\n\n")[0], re.M))
    used = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for s in re.findall(r'f"([^"]*)"', smk.read_text()):
            used |= set(re.findall(r"\{\{(\w+)\}\}", s))
        for s in re.findall(r'(?<![f\w])"(results/[^"]*)"', smk.read_text()):
            used |= set(re.findall(r"\{(\w+)\}", s))
    assert used and used <= constrained, used - constrained


@pytest.mark.slow
def test_a_path_outside_the_experiment_matches_no_rule(tmp_path):
    """partition / label wildcards only match the experiment's labels: a request for another
    path finds no rule instead of a KeyError traceback inside the train rule."""
    proc = run_snakemake(tmp_path, "--configfile", str(TEST_CONFIG), "--workflow-profile", str(REPO / "workflow/profiles/local"),
                         "results/test/runs/digits/evil/fedavg/seed0/metrics.json")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "MissingRuleException" in text and "KeyError" not in text, text[-2000:]


# ----------------------------------------------------------------- pickles: numpy arrays only


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_fedbn(root: Path, payload) -> Path:
    folder = root / dom.FEDBN_DIGITS_DIR / "MNIST_M"
    (folder / "partitions").mkdir(parents=True)
    with open(folder / "partitions" / "train_part0.pkl", "wb") as fh:
        pickle.dump(payload, fh)
    with open(folder / "test.pkl", "wb") as fh:
        pickle.dump((np.zeros((1, 28, 28, 3), np.uint8), np.zeros(1, np.int64)), fh)
    return folder


def test_a_planted_pickle_is_refused_and_never_run(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    _plant_fedbn(tmp_path / "raw", (_Evil(marker), np.zeros(1)))
    with pytest.raises(DataMissingError, match="posix.system; only numpy arrays"):
        load_dataset("mnistm", tmp_path / "raw", {"layout": "fedbn"})
    assert fedrepro_main(["prepare", "mnistm", "--root", str(tmp_path / "raw")]) == 2
    err = capsys.readouterr().err
    assert "only numpy arrays are allowed" in err and "Traceback" not in err
    assert not marker.exists()


def test_a_planted_pickle_inside_a_downloaded_zip_is_never_run(tmp_path, monkeypatch):
    from torchvision.datasets import utils as tvu

    marker = tmp_path / "MARKER"
    src = _plant_fedbn(tmp_path / "src", (_Evil(marker), np.zeros(1)))

    def fake(file_id, root, filename=None, md5=None):
        with zipfile.ZipFile(Path(root) / filename, "w") as zf:
            for f in src.rglob("*.pkl"):
                zf.write(f, Path("digit_dataset") / "MNIST_M" / f.relative_to(src))

    monkeypatch.setattr(tvu, "download_file_from_google_drive", fake)
    monkeypatch.setenv(dl.ALLOW_UNPINNED_ENV, "1")
    with pytest.raises(DataMissingError, match="only numpy arrays"):
        prepare_dataset("mnistm", tmp_path / "raw")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_real_numpy_pickles_still_load(tmp_path, protocol):
    x = np.arange(2 * 28 * 28 * 3, dtype=np.uint8).reshape(2, 28, 28, 3)
    y = np.array([[3], [10]])
    path = tmp_path / "p.pkl"
    with open(path, "wb") as fh:
        pickle.dump((x, y), fh, protocol)
    images, labels = dom.read_pkl_pair(path)
    np.testing.assert_array_equal(images, x)
    assert labels.tolist() == [3, 0]


def test_npy_files_holding_the_pair_load_without_pickle_execution(tmp_path):
    x, y = np.ones((2, 16, 16), np.uint8), np.array([1, 2])
    pair = np.empty(2, dtype=object)
    pair[0], pair[1] = x, y
    np.save(tmp_path / "p.npy", pair, allow_pickle=True)
    os.replace(tmp_path / "p.npy", tmp_path / "p.pkl")  # FedBN's .pkl files may be np.save output
    images, labels = dom.read_pkl_pair(tmp_path / "p.pkl")
    np.testing.assert_array_equal(images, x) and np.testing.assert_array_equal(labels, y)


# ------------------------------------------------------------------------- verified downloads


def _fake_download_url(monkeypatch, content: bytes, calls: list):
    from torchvision.datasets import utils as tvu

    def fake(url, root, filename=None, md5=None):
        calls.append(url)
        (Path(root) / filename).write_bytes(content)

    monkeypatch.setattr(tvu, "download_url", fake)


def test_fetch_verifies_the_pinned_sha256_before_use(tmp_path, monkeypatch):
    content = b"fixture archive bytes"
    good = dl.Download("f.bin", "https://example.org/f.bin", sha256=hashlib.sha256(content).hexdigest())
    calls: list = []
    _fake_download_url(monkeypatch, content, calls)
    with dl.recording() as records:
        path = dl.fetch(good, tmp_path)
    assert path.read_bytes() == content and records[0]["sha256"] == good.sha256 and records[0]["pinned"]
    assert dl.fetch(good, tmp_path) == path and len(calls) == 1  # present and verified: not downloaded again

    bad = dl.Download("g.bin", "https://example.org/g.bin", sha256="0" * 64)
    with pytest.raises(dl.DownloadVerificationError) as exc:
        dl.fetch(bad, tmp_path)
    msg = str(exc.value)
    assert "g.bin" in msg and "0" * 64 in msg and hashlib.sha256(content).hexdigest() in msg
    assert not (tmp_path / "g.bin").exists() and not list(tmp_path.glob(".*download")), "an unverified file was kept"


def test_a_planted_archive_at_the_download_path_is_verified_not_reused(tmp_path, monkeypatch):
    d = dl.Download("a.zip", "https://example.org/a.zip", md5=hashlib.md5(b"real").hexdigest(), size=4)
    (tmp_path / "a.zip").write_bytes(b"evil")
    calls: list = []
    _fake_download_url(monkeypatch, b"real", calls)
    with pytest.raises(dl.DownloadVerificationError, match="md5"):
        dl.fetch(d, tmp_path)
    assert calls == []


def test_unpinned_downloads_need_the_opt_in_and_record_their_sha256(tmp_path, monkeypatch):
    d = dl.Download("u.bin", "https://example.org/u.bin")
    calls: list = []
    _fake_download_url(monkeypatch, b"payload", calls)
    monkeypatch.delenv(dl.ALLOW_UNPINNED_ENV, raising=False)
    with pytest.raises(dl.UnpinnedDownloadError, match=dl.ALLOW_UNPINNED_ENV):
        dl.fetch(d, tmp_path)
    assert calls == []
    (tmp_path / "u.bin").write_bytes(b"leftover")  # never reused: no checksum to verify it by
    monkeypatch.setenv(dl.ALLOW_UNPINNED_ENV, "1")
    with dl.recording() as records:
        dl.fetch(d, tmp_path)
    assert (tmp_path / "u.bin").read_bytes() == b"payload" and calls == [d.url]
    assert records == [{"file": "u.bin", "url": d.url, "sha256": hashlib.sha256(b"payload").hexdigest(), "size": 7, "pinned": False}]


def test_every_domainnet_download_is_pinned():
    for d in dom.DOMAINNET_DOMAINS:
        for name in (f"{d}.zip", f"{d}_train.txt", f"{d}_test.txt"):
            pin = dom.domainnet_download(name)
            assert pin.pinned and len(pin.md5) == 32 and pin.size > 0 and pin.url.startswith("http://csr.bu.edu/")
    assert not dom.FEDBN_DIGITS_DOWNLOAD.pinned and not dom.PACS_DOWNLOAD.pinned  # docs/security.md lists them


def test_fedbn_and_pacs_downloads_are_refused_without_the_opt_in(tmp_path, monkeypatch):
    from torchvision.datasets import utils as tvu

    calls: list = []
    monkeypatch.setattr(tvu, "download_file_from_google_drive", lambda *a, **k: calls.append(a))
    monkeypatch.delenv(dl.ALLOW_UNPINNED_ENV, raising=False)
    for name in ("mnistm", "pacs"):
        with pytest.raises(DataMissingError, match="no published checksum"):
            prepare_dataset(name, tmp_path / name)
    assert calls == []


# ---------------------------------------------------- DomainNet: paths, extraction, renaming


def _png(path: Path, color=(200, 10, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), color).save(path)


def _domainnet(root: Path, train_line: str) -> Path:
    base = root / "DomainNet"
    _png(base / "clipart" / "bird" / "a.png")
    (base / "clipart_train.txt").write_text(train_line + "\n")
    (base / "clipart_test.txt").write_text("clipart/bird/a.png 0\n")
    return base


@pytest.mark.parametrize("line", ["clipart/bird/../../../outside/x.png 0", "/etc/passwd 0", "../outside/x.png 0"])
def test_domainnet_split_paths_cannot_leave_the_data_folder(tmp_path, line):
    _png(tmp_path / "outside" / "x.png")
    _domainnet(tmp_path / "raw", line)
    with pytest.raises(DataMissingError, match="leaves the data folder"):
        load_dataset("domainnet", tmp_path / "raw", {"domains": ["clipart"], "classes": 1, "image_size": 4})


def test_domainnet_split_paths_cannot_escape_through_a_symlink(tmp_path):
    _png(tmp_path / "outside" / "x.png")
    base = _domainnet(tmp_path / "raw", "clipart/bird/b.png 0")
    (base / "clipart" / "bird" / "b.png").symlink_to(tmp_path / "outside" / "x.png")
    with pytest.raises(DataMissingError, match="resolves outside"):
        load_dataset("domainnet", tmp_path / "raw", {"domains": ["clipart"], "classes": 1, "image_size": 4})


def test_malformed_split_lines_are_messages(tmp_path):
    _domainnet(tmp_path / "raw", "clipart/bird/a.png zero")
    with pytest.raises(DataMissingError, match="line 1"):
        load_dataset("domainnet", tmp_path / "raw", {"domains": ["clipart"], "classes": 1, "image_size": 4})


def test_mnistm_label_list_cannot_leave_its_folder(tmp_path):
    d = tmp_path / "mnist_m"
    for split in ("train", "test"):
        (d / f"mnist_m_{split}").mkdir(parents=True)
        (d / f"mnist_m_{split}_labels.txt").write_text("../../secret.png 1\n")
    with pytest.raises(DataMissingError, match="leaves the data folder"):
        load_dataset("mnistm", tmp_path, {"layout": "original"})


def _domainnet_zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_domainnet_prepare_verifies_extracts_aside_and_renames_into_place(tmp_path, monkeypatch):
    from io import BytesIO

    buf = BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, "PNG")
    zpath = tmp_path / "src.zip"
    _domainnet_zip(zpath, {"clipart/bird/a.png": buf.getvalue()})
    files = {"clipart.zip": zpath.read_bytes(), "clipart_train.txt": b"clipart/bird/a.png 0\n",
             "clipart_test.txt": b"clipart/bird/a.png 0\n"}
    pins = {k: (hashlib.md5(v).hexdigest(), len(v)) for k, v in files.items()}
    monkeypatch.setattr(dom.domainnet, "DOMAINNET_PINS", {**dom.DOMAINNET_PINS, **pins})
    from torchvision.datasets import utils as tvu

    monkeypatch.setattr(tvu, "download_url", lambda url, root, filename=None, md5=None: (Path(root) / filename).write_bytes(files[filename]))
    info = prepare_dataset("domainnet", tmp_path / "raw", {"domains": ["clipart"], "classes": 1, "image_size": 4})
    base = tmp_path / "raw" / "DomainNet"
    assert (base / "clipart" / "bird" / "a.png").is_file() and not (base / "clipart.zip").exists()
    assert sorted(p.name for p in base.iterdir()) == ["clipart", "clipart_test.txt", "clipart_train.txt"]
    assert {d["file"] for d in info["downloads"]} == set(files) and all(d["pinned"] for d in info["downloads"])

    # a killed extraction leaves no folder that looks complete
    import shutil

    shutil.rmtree(base / "clipart")
    monkeypatch.setattr(dl.shutil, "copyfileobj", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("domainnet", tmp_path / "raw", {"domains": ["clipart"], "classes": 1, "image_size": 4})
    assert not (base / "clipart").exists() and not [p for p in base.iterdir() if p.name.endswith(".extracting")]


def test_unsafe_archive_members_are_refused(tmp_path):
    _domainnet_zip(tmp_path / "slip.zip", {"../../evil.txt": b"x"})
    with pytest.raises(dl.UnsafeArchiveError, match="outside the extraction folder"):
        dl.extract_zip(tmp_path / "slip.zip", tmp_path / "out", "slip")
    with zipfile.ZipFile(tmp_path / "link.zip", "w") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(dl.UnsafeArchiveError, match="symbolic link"):
        dl.extract_zip(tmp_path / "link.zip", tmp_path / "out", "link")
    assert not (tmp_path.parent / "evil.txt").exists() and list((tmp_path / "out").iterdir()) == []


# ----------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_dir_swaps_a_directory_in(tmp_path, monkeypatch, exchange):
    import fedrepro.io as fio

    if not exchange:
        monkeypatch.setattr(fio, "_renameat2_exchange", lambda a, b: False)
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "old").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "fresh").write_text("new")
    replace_dir(tmp_path / "new", tmp_path / "dest")
    assert [p.name for p in tmp_path.iterdir()] == ["dest"] and os.listdir(tmp_path / "dest") == ["fresh"]


def test_shards_are_swapped_in_not_deleted_first(tmp_path, monkeypatch):
    import shutil

    import fedrepro.data.shards as shards
    from conftest import random_images

    spec = {"dataset": "random_images", "partitioner": "iid", "num_clients": 2}
    out = tmp_path / shards.partition_id(spec)
    shards.write_partition(random_images(40), spec, out)
    removed = []
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: removed.append((Path(p), Path(out).is_dir())))
    shards.write_partition(random_images(40), spec, out)
    assert removed and all(present for _, present in removed), "the shard folder was missing while it was replaced"
    assert (out / "manifest.json").is_file()


def test_atomic_path_fsyncs_the_directory(tmp_path, monkeypatch):
    import fedrepro.io as fio

    synced = []
    monkeypatch.setattr(fio, "fsync_dir", lambda p: synced.append(Path(p)))
    with atomic_path(tmp_path / "f.json") as tmp:
        tmp.write_text(json.dumps({}))
    assert synced == [tmp_path]
