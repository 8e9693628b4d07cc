"""Fault injection at the level of the workflow: what an operator sees when things break.

- a training job killed with SIGKILL mid-run (the job alone, or Snakemake with it): rerunning
  the workflow resumes from the checkpoint and ends with the metrics of an uninterrupted run;
- a corrupted byte in a Parquet shard is detected and the file is named;
- a full file system (a small tmpfs mounted for the test; RLIMIT_FSIZE where mounting is
  impossible) fails the job with a clear error and leaves no partial output;
- a diverging cell (lr 1e6, NaN loss) is recorded as failed with its reason, and the
  tables and the HTML report still render with the cell marked failed;
- no two jobs write the same file: every output, log, benchmark and checkpoint path of
  the DAG belongs to exactly one job, and atomic writes use unique temporary names.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from fedrepro.config import resolve_experiment
from fedrepro.data.shards import ShardChecksumError, load_partition, verify_partition

LOCAL_PROFILE = REPO / "workflow" / "profiles" / "local"
LOCAL_ARGS = ["--workflow-profile", str(LOCAL_PROFILE), "--cores", "2", "--set-threads", "train=1", "--resources", "gpu=2"]


def tiny_config(name: str, methods: dict | None = None, rounds: int = 2, **training) -> dict:
    return {
        "experiment": name,
        "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [16]}}}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 4, "seed": 0,
                               "params": {"alpha": 0.5, "min_partition_size": 20}}},
        "methods": methods or {"fedavg": {}},
        "training": {"rounds": rounds, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05},
                     "eval_every": 1, "checkpoint_every": 1, **training},
        "seeds": [0],
    }


def write_config(workdir: Path, config: dict) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "exp.yaml").write_text(yaml.safe_dump(config))
    return "exp.yaml"


def snakemake_cmd(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args]


def env() -> dict:
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(snakemake_cmd(workdir, *args), cwd=workdir, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_dir(workdir: Path, config: dict, label: str = "fedavg", seed: int = 0) -> Path:
    return workdir / "results" / config["experiment"] / "runs" / "digits" / "dir" / label / f"seed{seed}"


def train_log(workdir: Path, config: dict, label: str = "fedavg", seed: int = 0) -> Path:
    return workdir / "results" / config["experiment"] / "logs" / "train" / "digits" / "dir" / label / f"seed{seed}.log"


def checkpoint(workdir: Path, config: dict, label: str = "fedavg", seed: int = 0) -> Path:
    return workdir / "results" / config["experiment"] / "checkpoints" / "digits" / "dir" / label / f"seed{seed}.pt"


def shard_dir(workdir: Path, config: dict) -> Path:
    pid = resolve_experiment(copy.deepcopy(config))["partitions"][0]["id"]
    return workdir / "results" / "shards" / "digits" / pid


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A working folder whose results/raw and results/shards hold the digits data and the partition
    (with its plot) that every `tiny_config` experiment uses, made once by the workflow itself."""
    work = tmp_path_factory.mktemp("prepared")
    config = tiny_config("prepared")
    cfg = write_config(work, config)
    shards = shard_dir(work, config).relative_to(work)
    snakemake(work, str(shards), f"{shards}.png", "--configfile", cfg, *LOCAL_ARGS)  # (targets first: --resources takes several values)
    return work


def use_prepared(prepared: Path, workdir: Path, *subs: str) -> None:
    """Copy the prepared results/<sub> folders (raw, shards) into `workdir`: its workflow then starts at
    training, as on a rerun (the data preparation and partition jobs are not what these tests are about)."""
    for sub in subs or ("raw", "shards"):
        shutil.copytree(prepared / "results" / sub, workdir / "results" / sub)


def strip_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "resources"}


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- SIGKILL


def training_pids(workdir: Path) -> list[int]:
    """The `fedrepro train` processes whose working directory is `workdir`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        names = [os.path.basename(a.decode(errors="replace")) for a in argv[:3]]
        if "fedrepro" in names and b"train" in argv and cwd == str(workdir):
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def uninterrupted(prepared, tmp_path_factory):
    """Metrics of the long cell run without interruption (the reference)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    use_prepared(prepared, work)
    config = tiny_config("kill", rounds=150, eval_every=10, checkpoint_every=5)
    snakemake(work, "--configfile", write_config(work, config), *LOCAL_ARGS)
    return config, json.loads((run_dir(work, config) / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["job", "workflow"])
def test_sigkill_mid_run_then_workflow_rerun_resumes_to_the_uninterrupted_metrics(uninterrupted, prepared, tmp_path,
                                                                                  victim):
    """SIGKILL the training process (victim=job) or Snakemake and everything under it
    (victim=workflow, e.g. the machine lost power); rerun the workflow."""
    config, reference = uninterrupted
    use_prepared(prepared, tmp_path)
    cfg = write_config(tmp_path, config)
    ckpt = checkpoint(tmp_path, config)
    proc = subprocess.Popen(snakemake_cmd(tmp_path, "--configfile", cfg, *LOCAL_ARGS), cwd=tmp_path, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert ckpt.exists(), "no checkpoint was written"
        pids = training_pids(tmp_path)
        assert len(pids) == 1, pids
        if victim == "job":
            os.kill(pids[0], signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGKILL)  # (it is in the same session)
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not (run_dir(tmp_path, config) / "metrics.json").exists(), "the cell finished before the kill; raise rounds"
    assert ckpt.exists()
    if victim == "job":
        assert "Error in rule train" in out

    if victim == "workflow":
        # Snakemake died holding its lock: the documented recovery is --unlock, then rerun
        locked = snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS, check=False)
        assert locked.returncode != 0 and "cannot be locked" in locked.stdout + locked.stderr
        snakemake(tmp_path, "--configfile", cfg, "--unlock")
    rerun = snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS)
    log = train_log(tmp_path, config).read_text()
    done = int(re.search(r"resuming from the checkpoint after round (\d+)", log).group(1))
    metrics = json.loads((run_dir(tmp_path, config) / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["resources"]["resumed_from_round"] == done >= 5
    assert strip_timing(metrics) == strip_timing(reference)
    assert not ckpt.exists()


# ----------------------------------------------------------------------------- corrupted shard


@pytest.mark.slow
def test_corrupted_shard_byte_is_detected_and_the_file_named(prepared, tmp_path):
    config = tiny_config("corrupt", {"local": {}, "fedavg": {}})
    cfg = write_config(tmp_path, config)
    shards = shard_dir(tmp_path, config)
    use_prepared(prepared, tmp_path)  # the partition as the workflow wrote it
    verify_partition(shards)  # intact before the flip
    victim = shards / "client_00002.parquet"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the middle of the file
    victim.write_bytes(bytes(data))

    for check in (verify_partition, load_partition):
        with pytest.raises(ShardChecksumError) as exc:
            check(shards)
        assert str(victim) in str(exc.value) and "sha256" in str(exc.value)

    proc = snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS, check=False)
    assert proc.returncode != 0
    assert "Error in rule train" in proc.stdout + proc.stderr
    for label in config["methods"]:
        log = train_log(tmp_path, config, label).read_text()
        assert f"fedrepro train: error: {victim.relative_to(tmp_path)}: sha256" in log
        assert "does not match the manifest" in log and "corrupted" in log
        assert not (run_dir(tmp_path, config, label) / "metrics.json").exists()


# ----------------------------------------------------------------------------- full disk


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "256k"):
    """A tmpfs of `size` mounted at `path`; skips the test where mounting is impossible."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the RLIMIT_FSIZE variant covers this")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Write a file into `path` until its file system is full."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        (path / "probe").write_bytes(b"x" * 4096)
    (path / "probe").unlink(missing_ok=True)
    return filler


@pytest.mark.slow
def test_full_disk_fails_the_training_job_cleanly_and_a_rerun_completes(prepared, tmp_path):
    """results/<experiment>/runs on a full file system: the train job fails with ENOSPC before any
    work (issue 57: one line naming the folder and its free space, not an empty log or a run whose
    outputs cannot be written) and leaves nothing behind; once space is freed, the rerun completes."""
    config = tiny_config("fulldisk")
    cfg = write_config(tmp_path, config)
    use_prepared(prepared, tmp_path)
    runs = tmp_path / "results" / config["experiment"] / "runs"
    with small_filesystem(runs):
        filler = fill(runs)
        proc = snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS, check=False)
        assert proc.returncode != 0
        assert "Error in rule train" in proc.stdout + proc.stderr
        log = train_log(tmp_path, config).read_text()
        assert "No space left on device" in log
        assert "cannot write" in log and "free; allowed: at least" in log and "Traceback" not in log
        assert files_under(runs) == ["filler"], "the failed job left files behind"
        assert not checkpoint(tmp_path, config).exists()  # refused before training: no round was spent

        filler.unlink()
        snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS)
        metrics = json.loads((run_dir(tmp_path, config) / "metrics.json").read_text())
        assert metrics["status"] == "ok" and metrics["resources"]["resumed_from_round"] == 0
        assert files_under(runs) == [f"digits/dir/fedavg/seed0/{f}" for f in ("final_model.pt", "metrics.json", "provenance.json")]


@pytest.mark.slow
def test_forced_retrain_failing_on_a_full_disk_keeps_the_earlier_result(prepared, tmp_path):
    """A finished cell retrained with --forcerun while its runs folder is full: the job fails,
    and the earlier metrics.json and provenance.json are still there, byte for byte (Snakemake
    deletes a job's outputs before it starts unless they are flagged update(), as train's are)."""
    config = tiny_config("forced")
    cfg = write_config(tmp_path, config)
    use_prepared(prepared, tmp_path)
    runs = tmp_path / "results" / config["experiment"] / "runs"
    with small_filesystem(runs):
        snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS)
        results = {name: (run_dir(tmp_path, config) / name).read_bytes() for name in ("metrics.json", "provenance.json")}
        for name in results:  # second links: deleting the outputs frees no space, the disk stays full
            os.link(run_dir(tmp_path, config) / name, runs / f"held-{name}")
        fill(runs)
        proc = snakemake(tmp_path, "--forcerun", "train", "--configfile", cfg, *LOCAL_ARGS, check=False)
        assert proc.returncode != 0 and "Error in rule train" in proc.stdout + proc.stderr
        assert "No space left on device" in train_log(tmp_path, config).read_text()
        for name, data in results.items():
            assert (run_dir(tmp_path, config) / name).read_bytes() == data, f"the failed retrain lost {name}"
        assert files_under(runs) == ["digits/dir/fedavg/seed0/final_model.pt", "digits/dir/fedavg/seed0/metrics.json",
                                     "digits/dir/fedavg/seed0/provenance.json", "filler", "held-metrics.json",
                                     "held-provenance.json"], "the failed job left files"


@pytest.mark.slow
def test_full_disk_fails_partitioning_cleanly(prepared, tmp_path):
    config = tiny_config("fulldisk_shards")
    cfg = write_config(tmp_path, config)
    use_prepared(prepared, tmp_path, "raw")  # the data, not the partition: that job must run
    shards = shard_dir(tmp_path, config)
    with small_filesystem(shards.parent):
        fill(shards.parent)
        proc = snakemake(tmp_path, str(shards.relative_to(tmp_path)), "--configfile", cfg, *LOCAL_ARGS, check=False)
        assert proc.returncode != 0 and "Error in rule partition" in proc.stdout + proc.stderr
        log = tmp_path / "results" / "logs" / "partition" / f"digits-{shards.name}.log"
        assert "No space left on device" in log.read_text()
        assert files_under(shards.parent) == ["filler"]  # no shard directory, no temporary one
        assert sorted(p.name for p in shards.parent.iterdir()) == ["filler"]


@pytest.mark.parametrize("limit", ["rlimit_fsize", "tmpfs"])
def test_failed_write_keeps_the_previous_metrics_intact(tiny_partition, make_cell, tmp_path, limit):
    """`fedrepro train` into a directory that cannot take its outputs (a full tmpfs, or
    RLIMIT_FSIZE of 1 KiB, the fallback where mounting is impossible): it fails with the
    OS error, the metrics.json of an earlier run stays byte for byte, and no temporary or
    half-written file is left."""
    shards, _ = tiny_partition
    cell = make_cell("fedavg")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedrepro", "train", "--cell", json.dumps(cell), "--shards", str(shards),
           "--out-dir", str(out), "--threads", "1"]
    old = json.dumps({"status": "ok", "note": "an earlier, complete result"}, indent=2) + "\n"

    def limit_file_size():  # provenance.json is a few KiB; Python ignores SIGXFSZ, so write() fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    with contextlib.ExitStack() as stack:
        if limit == "tmpfs":
            stack.enter_context(small_filesystem(out, size="64k"))
        out.mkdir(exist_ok=True)
        (out / "metrics.json").write_text(old)
        before = ["metrics.json"]
        if limit == "tmpfs":
            fill(out)
            before.append("filler")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env(), timeout=300,
                              preexec_fn=limit_file_size if limit == "rlimit_fsize" else None)
        expected = "File too large" if limit == "rlimit_fsize" else "No space left on device"
        assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
        if limit == "tmpfs":  # one line naming the file, not a traceback
            assert f"cannot write {out}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert sorted(p.name for p in out.iterdir()) == sorted(before)
        assert (out / "metrics.json").read_text() == old


# ----------------------------------------------------------------------------- diverging cell


def embedded_csvs(report_html: str) -> dict[str, str]:
    """{file name: text} of the CSV files the Snakemake report embeds as data URIs."""
    out = {}
    for m in re.finditer(r"data:text/csv;charset=utf8;filename=([^;]+);base64,([A-Za-z0-9+/=]+)", report_html):
        out[m.group(1)] = base64.b64decode(m.group(2)).decode()
    return out


@pytest.mark.slow
def test_diverging_cell_is_failed_with_its_reason_and_tables_and_report_render(prepared, tmp_path):
    label = "fedavg_lr1e6"
    config = tiny_config("diverge", {"fedavg": {}, label: {"method": "fedavg", "training": {"optimizer": {"lr": 1.0e6}}}})
    cfg = write_config(tmp_path, config)
    use_prepared(prepared, tmp_path)
    snakemake(tmp_path, "--configfile", cfg, *LOCAL_ARGS)  # a diverged cell is a result, not a failed job
    snakemake(tmp_path, "--configfile", cfg, "--report", "results/diverge/report.html")
    out = tmp_path / "results" / "diverge"
    tex_label = label.replace("_", "\\_")

    m = json.loads((run_dir(tmp_path, config, label) / "metrics.json").read_text())
    assert m["status"] == "failed"
    reason = m["failure"]["reason"]
    assert "nan" in reason and "diverged" in reason, reason
    assert f"FAILED: {reason}" in train_log(tmp_path, config, label).read_text()
    assert json.loads((run_dir(tmp_path, config) / "metrics.json").read_text())["status"] == "ok"

    summary = (out / "summary.csv").read_text()
    assert f",{label},mlp,0,failed,{reason},failed," in summary
    for name in ("accuracy", "accuracy_client_mean", "accuracy_worst10", "macro_f1"):
        md = (out / "tables" / f"{name}.md").read_text()
        assert re.search(rf"^\| {label} \| failed \|$", md, re.M), md
        assert re.search(r"^\| fedavg \(global\) \| \d+\.\d+ \|$", md, re.M), md
        tex = (out / "tables" / f"{name}.tex").read_text()
        assert tex_label + r" & failed \\" in tex.splitlines(), tex
        csv = (out / "tables" / f"{name}.csv").read_text()
        assert f"\n{label},failed,,,0,1\n" in csv
    report = (out / "report.html").read_text()
    tables = embedded_csvs(report)
    assert {"accuracy.csv", "macro_f1.csv"} <= set(tables)
    for name, text in tables.items():
        assert f"\n{label},failed,,,0,1\n" in text, name
    for png in ("curves_digits_dir.png", "clients_digits_dir.png"):
        assert png in report and (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- no shared files

DAG_SCRIPT = r"""
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings, StorageSettings, Quietness

snakefile, workdir, configfile = sys.argv[1:4]
with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
    wf = api.workflow(snakefile=Path(snakefile), workdir=Path(workdir),
                      config_settings=ConfigSettings(configfiles=[Path(configfile)]) if configfile else ConfigSettings(),
                      resource_settings=ResourceSettings(cores=1), storage_settings=StorageSettings())
    dag_api = wf.dag(dag_settings=DAGSettings(forceall=True))
    workflow = dag_api.workflow_api._workflow
    workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True)
    workflow._build_dag()
    jobs = []
    for job in workflow.dag.jobs:
        params = dict(job.params.items()) if hasattr(job.params, "items") else {}
        jobs.append({
            "rule": job.rule.name, "jobid": job.jobid, "wildcards": dict(job.wildcards_dict),
            "output": [str(f) for f in job.output], "directories": [str(f) for f in job.output if f.is_directory],
            "log": [str(f) for f in job.log], "benchmark": str(job.benchmark) if job.benchmark else None,
            "checkpoint": params.get("checkpoint"), "shell": job.rule.shellcmd,
        })
print("JOBS=" + json.dumps(jobs))
"""


def dag_jobs(tmp_path: Path, configfile: Path | None) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", DAG_SCRIPT, str(REPO / "Snakefile"), str(tmp_path),
                           str(configfile) if configfile else ""],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("JOBS=")), None)
    assert line, f"could not build the DAG:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line.removeprefix("JOBS="))


@pytest.mark.slow
@pytest.mark.parametrize("configfile", [REPO / "config" / "test.yaml", None,
                                        REPO / "config" / "experiments" / "baselines_fmnist.yaml",
                                        REPO / "config" / "experiments" / "baselines_fmnist_tuned_quick.yaml"],
                         ids=["test.yaml", "default", "baselines_fmnist", "baselines_fmnist_tuned_quick"])
def test_no_two_jobs_of_the_dag_write_the_same_file(tmp_path, configfile):
    if configfile is not None and not configfile.exists():
        pytest.skip(f"{configfile} is not in this checkout")
    jobs = dag_jobs(tmp_path, configfile)
    writers: dict[str, list[str]] = {}
    for job in jobs:
        ident = f"{job['rule']}#{job['jobid']}"
        paths = [*job["output"], *job["log"], *([job["benchmark"]] if job["benchmark"] else []),
                 *([job["checkpoint"]] if job["checkpoint"] else [])]
        if job["rule"] in ("train", "train_tuned", "tune_trial"):
            assert job["checkpoint"], "a training job without a checkpoint path"
            paths.append(os.path.dirname(job["output"][0]) + "/")  # its --out-dir
        assert len(paths) == len(set(paths)), f"{ident} names a path twice: {paths}"
        for p in paths:
            writers.setdefault(os.path.normpath(p) + ("/" if p.endswith("/") else ""), []).append(ident)
    shared = {p: w for p, w in writers.items() if len(w) > 1}
    assert not shared, f"paths written by several jobs: {dict(list(shared.items())[:5])}"
    # nothing is written inside another job's directory output (e.g. a shard folder)
    directories = {os.path.normpath(d): f"{j['rule']}#{j['jobid']}" for j in jobs for d in j["directories"]}
    for path, (owner,) in writers.items():
        for d, dir_owner in directories.items():
            if dir_owner != owner and os.path.normpath(path).startswith(d + os.sep):
                raise AssertionError(f"{owner} writes {path} inside {dir_owner}'s directory {d}")
    # one prepare_data job per dataset: results/raw/<dataset>/ (downloads, staging folders) has one writer
    prepared = [j["wildcards"]["dataset"] for j in jobs if j["rule"] == "prepare_data"]
    assert len(prepared) == len(set(prepared)), prepared
    n_train = sum(j["rule"] in ("train", "train_tuned") for j in jobs)
    if configfile is not None and configfile.name == "test.yaml":
        assert n_train == 12
    assert n_train >= 1


def test_atomic_writes_use_unique_temporary_names_beside_the_target():
    source = (REPO / "src" / "fedrepro" / "io.py").read_text()
    # unique names (mkstemp / mkdtemp) that carry the creator's host and pid, so dead ones can be cleaned
    assert 'tempfile.mkstemp(prefix=tmp_prefix(path.name), suffix=".tmp", dir=path.parent)' in source
    assert "tempfile.mkdtemp(prefix=tmp_prefix(name), suffix=suffix, dir=parent)" in source
    assert "os.replace(tmp_path, path)" in source
    assert "tmp_dir = staging_dir(out_dir.parent, out_dir.name)" in (REPO / "src" / "fedrepro" / "data" / "shards.py").read_text()
    # Nowhere else is a temporary name built by hand (a fixed "<name>.tmp" would collide),
    # except the download staging folders of data/domains/: they live in
    # results/raw/<dataset>/, which only that dataset's single prepare_data job writes
    # (checked in test_no_two_jobs_of_the_dag_write_the_same_file), and Snakemake's
    # directory lock keeps a second workflow out of the same results/.
    allowed = {(f"data/domains/{m}.py", "staging = root / f\".") for m in ("fedbn_digits", "pacs", "domainnet")}
    offenders = []
    for py in (REPO / "src" / "fedrepro").rglob("*.py"):
        if py.name == "io.py":
            continue
        rel = str(py.relative_to(REPO / "src" / "fedrepro"))
        for n, line in enumerate(py.read_text().splitlines(), 1):
            if re.search(r"""["'][^"']*\.(tmp|part|partial)["']|with_suffix\(\s*["']\.tmp""", line):
                if not any(rel == f and line.strip().startswith(prefix) for f, prefix in allowed):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_concurrent_atomic_writers_of_one_file_never_expose_a_partial_file(tmp_path):
    """Two processes rewrite the same JSON file 200 times each while this one reads it."""
    target = tmp_path / "metrics.json"
    writer = ("import sys; from fedrepro.io import write_json_atomic\n"
              "for i in range(200): write_json_atomic(sys.argv[1], {'writer': sys.argv[2], 'i': i, 'pad': 'x' * 50000})\n")
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(target), name], env=env()) for name in ("a", "b")]
    seen, bad = set(), []

    def read_loop():
        while any(p.poll() is None for p in procs):
            try:
                obj = json.loads(target.read_text())
            except FileNotFoundError:
                continue
            except json.JSONDecodeError as exc:
                bad.append(str(exc))
                continue
            seen.add(obj["writer"])

    reader = threading.Thread(target=read_loop)
    reader.start()
    for p in procs:
        assert p.wait(timeout=300) == 0
    reader.join()
    assert not bad, bad[:3]
    assert json.loads(target.read_text())["i"] == 199
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporary left


def test_atomic_writes_are_readable_by_collaborators(tmp_path):
    """mkstemp creates 0600 files; results on a shared cluster must follow the umask instead."""
    from fedrepro.io import write_text_atomic

    mask = os.umask(0)
    os.umask(mask)
    write_text_atomic(tmp_path / "metrics.json", "{}")
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == 0o666 & ~mask


# ----------------------------------------------------------------------------- checkpoints


def _genuine_checkpoint(cell: dict, shards: Path, path: Path, monkeypatch) -> dict:
    """A real checkpoint of `cell` after its round 1 (the run stopped in round 2): its state."""
    import torch

    from fedrepro.engine.run import train_cell
    from fedrepro.methods import METHODS

    cls = METHODS.get(cell["method"])
    original = cls.aggregate

    def stop_in_round_2(self, updates):
        if self.engine.round == 2:
            raise KeyboardInterrupt("simulated kill")
        return original(self, updates)

    with monkeypatch.context() as m:
        m.setattr(cls, "aggregate", stop_in_round_2)
        with pytest.raises(KeyboardInterrupt):
            train_cell(cell, shards, path.parent / "unused", checkpoint=path, progress=False)
    return torch.load(path, weights_only=True)


def _damage(kind: str, path: Path, state: dict, other_cell_state: dict) -> None:
    import datetime
    import pickle

    import torch

    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "directory":
        path.unlink()
        (path / "inside").mkdir(parents=True)
    elif kind == "pickle":  # a plain pickle of a non-tensor object: refused by weights_only=True
        path.write_bytes(pickle.dumps({"round": 1, "when": datetime.date(2024, 1, 1)}))
    elif kind == "empty_history":
        torch.save(state | {"history": []}, path)
    elif kind in ("round_0", "round_beyond"):
        torch.save(state | {"round": 0 if kind == "round_0" else 3}, path)
    elif kind == "foreign":  # another seed's genuine checkpoint, copied over this cell's
        torch.save(other_cell_state, path)
    elif kind == "other_shards":  # this cell, but trained on other shards
        torch.save(state | {"identity": state["identity"] | {"manifest_hash": "0" * 64}}, path)
    elif kind == "older_format":  # before identities: only the cell key (what was believed before)
        torch.save({"cell_key": state["identity"]["cell_key"]} | {k: v for k, v in state.items() if k != "identity"}, path)


CORRUPTIONS = ["truncated", "directory", "pickle", "empty_history", "round_0", "round_beyond", "foreign", "other_shards",
               "older_format"]


@pytest.fixture(scope="module")
def checkpoint_states(tiny_partition, tmp_path_factory):
    """Genuine checkpoints (after round 1 of 3) of the fedavg cell, seeds 0 and 1, and seed 0's fresh metrics."""
    from fedrepro.engine.run import train_cell

    from conftest import tiny_config as unit_config

    shards = tiny_partition[0]
    cell = next(c for c in resolve_experiment(unit_config(rounds=3, checkpoint_every=1, eval_every=1))["cells"]
                if c["label"] == "fedavg")
    cells = [cell | {"seed": seed} for seed in (0, 1)]
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("ckpts")
    try:
        states = [_genuine_checkpoint(c, shards, tmp / f"seed{c['seed']}.pt", mp) for c in cells]
    finally:
        mp.undo()
    fresh = train_cell(cells[0], shards, tmp / "fresh", progress=False)
    return cells[0], states, fresh


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_damaged_or_foreign_checkpoint_is_moved_aside_and_the_cell_trains_from_round_0(
        tiny_partition, checkpoint_states, tmp_path, capfd, kind):
    """Before: a foreign checkpoint with a matching cell key was believed (its rounds skipped), a
    corrupt one failed every retry with torch's traceback. Now each is renamed aside with one
    warning naming it and why, and the cell's metrics equal a fresh run's."""
    import torch

    from fedrepro.engine.run import train_cell

    cell, (state, other), fresh = checkpoint_states
    ckpt = tmp_path / "ckpt.pt"
    torch.save(state, ckpt)
    _damage(kind, ckpt, state, other)
    capfd.readouterr()
    metrics = train_cell(cell, tiny_partition[0], tmp_path / "out", checkpoint=ckpt, progress=False)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "warning: checkpoint" in line]
    assert len(warnings) == 1 and str(ckpt) in warnings[0] and "moved aside" in warnings[0], err
    assert "Traceback" not in err and "weights_only=False" not in err and "resuming" not in err
    assert metrics["resources"]["resumed_from_round"] == 0
    assert strip_timing(metrics) == strip_timing(fresh)
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.pt.rejected-")]
    assert len(aside) == 1 and not os.path.lexists(ckpt)  # kept for inspection; the finished cell removed its own


def test_a_genuine_checkpoint_is_still_resumed_from(tiny_partition, checkpoint_states, tmp_path, capfd):
    import torch

    from fedrepro.engine.run import train_cell

    cell, (state, _), fresh = checkpoint_states
    ckpt = tmp_path / "ckpt.pt"
    torch.save(state, ckpt)
    metrics = train_cell(cell, tiny_partition[0], tmp_path / "out", checkpoint=ckpt, progress=False)
    assert "resuming from the checkpoint after round 1" in capfd.readouterr().err
    assert metrics["resources"]["resumed_from_round"] == 1
    assert strip_timing(metrics) == strip_timing(fresh)


# ----------------------------------------------------------------------------- full disk, simulated


def _enospc_after(limit: int):
    """A write() that takes `limit` bytes, then fails as a full disk does."""
    import errno

    written = {"n": 0}

    def write(fh_write):
        def inner(data):
            if written["n"] + len(data) > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            written["n"] += len(data)
            return fh_write(data)
        return inner
    return write


@pytest.mark.parametrize("how", ["oserror", "torch_runtime_error"])
def test_full_disk_while_writing_a_checkpoint_is_the_documented_message(tiny_partition, make_cell, tmp_path,
                                                                       monkeypatch, capsys, how):
    """The disk fills while `fedrepro train` writes its checkpoint: the documented one-line message
    naming the checkpoint (docs/operations.md), not torch's `unexpected pos`; no file is left."""
    import shutil as shutil_mod

    import torch

    from fedrepro.cli import main
    from fedrepro.engine import engine as engine_mod

    real_save = torch.save

    def save_on_full_disk(obj, f, *args, **kwargs):
        if how == "torch_runtime_error":  # what torch's own file writer (torch.save to a path) raises
            f.write(b"PK\x03\x04partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4310")

        class Full:  # the real serializer, writing into a file system that fills after 1 KiB
            write = staticmethod(_enospc_after(1024)(f.write))

            def flush(self):
                return f.flush()
        return real_save(obj, Full(), *args, **kwargs)

    monkeypatch.setattr(engine_mod.torch, "save", save_on_full_disk)
    if how == "torch_runtime_error":
        usage = shutil_mod.disk_usage(tmp_path)
        monkeypatch.setattr("fedrepro.io.shutil.disk_usage", lambda p: usage._replace(free=0))
    cell = make_cell("fedavg", rounds=3, checkpoint_every=1)
    ckpt = tmp_path / "ckpt" / "seed0.pt"
    rc = main(["train", "--cell", json.dumps(cell), "--shards", str(tiny_partition[0]), "--out-dir", str(tmp_path / "out"),
               "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1] == (f"fedrepro train: error: No space left on device: cannot write {ckpt} "
                                                "(nothing was written)"), err[-2000:]
    assert "Traceback" not in err and "unexpected pos" not in err
    assert list(ckpt.parent.iterdir()) == []  # neither the checkpoint nor a temporary file
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["provenance.json", "metrics.json"])
def test_full_disk_while_writing_results_is_the_documented_message(tiny_partition, make_cell, tmp_path, monkeypatch,
                                                                  capsys, name):
    import errno

    from fedrepro.cli import main
    from fedrepro.io import tmp_prefix

    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name.startswith(tmp_prefix(name)):  # atomic_path's temporary file for `name`
            real(self, text[:100], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "out"
    rc = main(["train", "--cell", json.dumps(make_cell("fedavg")), "--shards", str(tiny_partition[0]), "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1] == (f"fedrepro train: error: No space left on device: cannot write {out / name} "
                                                "(nothing was written)"), err[-2000:]
    assert name not in [p.name for p in out.iterdir()] and not any(p.name.endswith(".tmp") for p in out.iterdir())
