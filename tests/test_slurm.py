"""The SLURM profile on a real single-node SLURM cluster.

workflow/scripts/slurm_up.sh starts munge, MariaDB + slurmdbd, slurmctld and slurmd from
Debian's packages (installing them when missing) with two partitions over this host and
its real CPUs and memory, plus two placeholder GPUs (gres/gpu without a device) so that
jobs submitted with --gpus=1 are scheduled; slurm_down.sh stops everything afterwards.

A tiny experiment runs through `snakemake --workflow-profile workflow/profiles/slurm` with
the override documented in the README (account and partitions), plus what this host
needs: train's 8 threads and 32 GB do not fit a small test machine, so train gets 1 thread
and 1 GB. The tests then check, with sacct and the jobs' provenance, that every training
cell was its own SLURM job with the declared partition, account, CPUs, memory, GPU and
time limit; that the profile's own training submission carries the GPU request; and that a
training job cancelled with scancel is resubmitted by the profile's retries and resumes
from its checkpoint (the profile takes job states from squeue: with sacct, the plugin
does not recognise "CANCELLED by <uid>" and waits forever; see docs/operations.md).

Skipped only where the SLURM packages cannot be installed (not root, no apt).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPTS = REPO / "workflow" / "scripts"
PROFILE = REPO / "workflow" / "profiles" / "slurm"
ACCOUNT = "fedrepro_test"
CPU_PART, GPU_PART = "cpu_test", "gpu_test"
EXPERIMENT = "slurm"

# The README's override (account, CPU partition, GPU partition for train), plus what a
# small test host needs, plus a short first status check (the plugin's default is 40 s).
OVERRIDES = [
    "--default-resources", f"slurm_account={ACCOUNT}", f"slurm_partition={CPU_PART}",
    "--set-resources", f"train:slurm_partition={GPU_PART}", "train:mem_mb=1000",
    "--set-threads", "train=1",
    "--slurm-init-seconds-before-status-checks", "2",
    "--slurm-keep-successful-logs",
    "--verbose",  # logs every sbatch call
]


def tiny_config(name: str, methods: dict, rounds: int, **training) -> dict:
    return {
        "experiment": name,
        "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [16]}}}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 4, "seed": 0,
                               "params": {"alpha": 0.5, "min_partition_size": 20}}},
        "methods": methods,
        "training": {"rounds": rounds, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05},
                     "eval_every": 1, "checkpoint_every": 1, **training},
        "seeds": [0],
    }


# ----------------------------------------------------------------------------- helpers


def run(cmd: list, env: dict, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def start_snakemake(cluster, workdir: Path, *args: str, log_name: str) -> tuple[subprocess.Popen, Path]:
    log = workdir / log_name
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--workflow-profile", str(PROFILE), *args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=workdir, env=cluster.env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def wait(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"snakemake did not finish within {timeout} s:\n{log.read_text()[-4000:]}")
    return log.read_text()


def snakemake(cluster, workdir: Path, *args: str, log_name: str, timeout: float = 900) -> tuple[int, str]:
    proc, log = start_snakemake(cluster, workdir, *args, log_name=log_name)
    text = wait(proc, log, timeout)
    return proc.returncode, text


def sacct(cluster, *jobids: str) -> list[dict]:
    fields = ["JobID", "JobName", "Partition", "Account", "State", "AllocTRES", "Timelimit", "Comment"]
    cmd = ["sacct", "-X", "--parsable2", "--noheader", "--format", ",".join(fields)]
    cmd += ["-j", ",".join(jobids)] if jobids else ["--allusers", "--starttime", "now-1days"]
    out = run(cmd, cluster.env).stdout
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]


def tres(row: dict) -> dict:
    return dict(kv.split("=", 1) for kv in row["AllocTRES"].split(",") if "=" in kv)


def sbatch_calls(text: str, rule: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("sbatch call:") and f"--comment rule_{rule}" in line]


def submitted(call: str) -> str:
    """The sbatch options of a logged call, without the wrapped Snakemake command."""
    return call.split(" --wrap=")[0]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm") / "cluster"
    t0 = time.time()
    up = subprocess.run(["bash", str(SCRIPTS / "slurm_up.sh"), "--dir", str(state), "--account", ACCOUNT,
                         "--partitions", f"{CPU_PART} {GPU_PART}", "--gpus", "2"],
                        capture_output=True, text=True, timeout=1200)
    if up.returncode == 3:
        pytest.skip(f"no SLURM cluster on this machine: {up.stderr.strip().splitlines()[-1]}")
    down = ["bash", str(SCRIPTS / "slurm_down.sh"), "--dir", str(state)]
    if up.returncode != 0:
        subprocess.run(down, capture_output=True, timeout=300)
        pytest.fail(f"slurm_up.sh failed ({up.returncode}):\n{up.stderr[-4000:]}")
    env = {**os.environ, "SLURM_CONF": str(state / "etc" / "slurm.conf"),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"], "/usr/sbin", "/sbin"])}
    print(f"cluster up in {time.time() - t0:.0f} s: {up.stderr.strip().splitlines()[-1]}")
    try:
        yield SimpleNamespace(dir=state, env=env)
    finally:
        subprocess.run(down, capture_output=True, timeout=300)
        assert not state.exists()


@pytest.fixture(scope="module")
def slurm_run(cluster, tmp_path_factory):
    """The tiny experiment (local + fedavg, 2 rounds) run through the SLURM profile."""
    work = tmp_path_factory.mktemp("slurm_wf")
    config = tiny_config(EXPERIMENT, {"local": {}, "fedavg": {}}, rounds=2)
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    rc, text = snakemake(cluster, work, "--configfile", "tiny.yaml", *OVERRIDES, log_name="run.log")
    assert rc == 0, f"the SLURM run failed:\n{text[-6000:]}"
    names = set(re.findall(r"^sbatch call: sbatch --parsable --job-name (\S+)", text, re.M))
    assert len(names) == 1, names  # one name (fedrepro_<run uuid>) for all jobs of a run
    return SimpleNamespace(work=work, config=config, log=text, jobname=names.pop())


# ----------------------------------------------------------------------------- tests


def test_slurm_up_describes_this_host(cluster):
    conf = (cluster.dir / "etc" / "slurm.conf").read_text()
    layout = run(["slurmd", "-C"], cluster.env).stdout.splitlines()[0]
    cpus = re.search(r"CPUs=(\d+)", layout).group(1)
    memory = re.search(r"RealMemory=(\d+)", layout).group(1)
    assert f"CPUs={cpus}" in conf and f"RealMemory={memory}" in conf
    node = run(["scontrol", "show", "node"], cluster.env).stdout
    assert f"CPUTot={cpus}" in node and "gres/gpu=2" in node
    parts = run(["sinfo", "-h", "-o", "%R %a"], cluster.env).stdout.splitlines()
    assert sorted(parts) == sorted([f"{CPU_PART} up", f"{GPU_PART} up"])
    assert ACCOUNT in run(["sacctmgr", "-n", "-P", "list", "account", "format=account"], cluster.env).stdout.split()
    assert Path("/etc/slurm/slurm.conf").resolve() == (cluster.dir / "etc" / "slurm.conf").resolve()


def test_every_training_cell_is_its_own_slurm_job_with_the_declared_resources(cluster, slurm_run):
    config, work = slurm_run.config, slurm_run.work
    cells = [(label, seed) for label in config["methods"] for seed in config["seeds"]]
    jobids = {}
    for label, seed in cells:
        run_dir = work / "results" / EXPERIMENT / "runs" / "digits" / "dir" / label / f"seed{seed}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "ok" and metrics["rounds"] == 2
        slurm = json.loads((run_dir / "provenance.json").read_text())["slurm"]
        assert slurm["SLURM_JOB_PARTITION"] == GPU_PART
        jobids[(label, seed)] = slurm["SLURM_JOB_ID"]
    assert len(set(jobids.values())) == len(cells), f"cells shared a SLURM job: {jobids}"

    rows = {r["JobID"]: r for r in sacct(cluster, *jobids.values())}
    for (label, seed), jobid in jobids.items():
        row = rows[jobid]
        assert row["State"] == "COMPLETED"
        assert row["Partition"] == GPU_PART and row["Account"] == ACCOUNT
        assert row["Comment"] == f"rule_train_wildcards_digits_dir_{label}_{seed}"
        assert row["JobName"].startswith("fedrepro_")  # slurm-jobname-prefix of the profile
        t = tres(row)
        assert t["cpu"] == "1" and t["mem"] == "1000M" and t["gres/gpu"] == "1", row["AllocTRES"]
        assert row["Timelimit"] == "04:00:00"  # runtime 240 (rule and profile)

    # one SLURM job per cell, and no other training job in this run
    train_rows = [r for r in sacct(cluster) if r["JobName"] == slurm_run.jobname and r["Comment"].startswith("rule_train_")]
    assert sorted(r["JobID"] for r in train_rows) == sorted(jobids.values())

    for call in sbatch_calls(slurm_run.log, "train"):
        opts = submitted(call)
        assert " --gpus=1" in opts and f"-p {GPU_PART}" in opts and f"-A {ACCOUNT}" in opts and "-t 240" in opts


def test_data_preparation_runs_on_the_cpu_partition_and_aggregation_locally(cluster, slurm_run):
    rows = [r for r in sacct(cluster) if r["JobName"] == slurm_run.jobname]
    by_rule = {}
    for r in rows:
        rule = re.match(r"rule_(\w+?)_wildcards_", r["Comment"] + "_wildcards_").group(1)
        by_rule.setdefault(rule, []).append(r)
    for rule, minutes in (("prepare_data", "01:00:00"), ("partition", "01:00:00")):
        assert len(by_rule.get(rule, [])) == 1, f"{rule}: {by_rule.get(rule)}"
        row = by_rule[rule][0]
        assert row["State"] == "COMPLETED" and row["Partition"] == CPU_PART and row["Account"] == ACCOUNT
        assert "gres/gpu" not in row["AllocTRES"] and row["Timelimit"] == minutes
    for rule in ("aggregate", "tables", "plots", "plot_partition"):  # localrule: True
        assert rule not in by_rule
    out = slurm_run.work / "results" / EXPERIMENT
    assert "fedavg" in (out / "tables" / "accuracy.md").read_text()


def test_profile_training_submission_requests_a_gpu(cluster, slurm_run, tmp_path):
    """The sbatch command of a training job carries the profile's GPU request.

    A fresh working directory with the shards of the run above and no metrics: only
    one train job is needed. First with the profile as it is (only the account
    overridden): -p gpu, --gpus=1, 8 CPUs, 32000 MB, 240 min. No partition 'gpu' here,
    so sbatch refuses it; the plugin logs the call either way. Then with the README's
    override of the partitions: still --gpus=1 and 8 CPUs; on this host the job exceeds
    the node (EnforcePartLimits=ALL refuses it) unless the node has 8 CPUs.
    """
    for sub in ("raw", "shards"):
        shutil.copytree(slurm_run.work / "results" / sub, tmp_path / "results" / sub)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(slurm_run.config))
    target = f"results/{EXPERIMENT}/runs/digits/dir/fedavg/seed0/metrics.json"
    common = ["--configfile", "tiny.yaml", "--slurm-init-seconds-before-status-checks", "2", "--retries", "0",
              "--verbose", target]

    _, text = snakemake(cluster, tmp_path, "--default-resources", f"slurm_account={ACCOUNT}", *common,
                        log_name="profile.log", timeout=300)
    calls = sbatch_calls(text, "train")
    assert len(calls) == 1, text[-3000:]
    opts = submitted(calls[0])
    for flag in (" --gpus=1", " -p gpu ", f" -A {ACCOUNT} ", " --mem 32000 ", " -t 240 ", " --cpus-per-task=8 "):
        assert flag in opts + " ", f"{flag!r} not in {opts}"
    assert "Invalid partition name specified" in text  # there is no 'gpu' partition on this cluster

    _, text = snakemake(cluster, tmp_path, "--default-resources", f"slurm_account={ACCOUNT}", f"slurm_partition={CPU_PART}",
                        "runtime=30", "mem_mb=4000", "--set-resources", f"train:slurm_partition={GPU_PART}", "train:gpu=1",
                        "train:mem_mb=32000", "train:runtime=240", *common, log_name="readme.log", timeout=600)
    calls = sbatch_calls(text, "train")
    assert len(calls) == 1, text[-3000:]
    opts = submitted(calls[0])
    for flag in (" --gpus=1", f" -p {GPU_PART} ", f" -A {ACCOUNT} ", " -t 240 ", " --cpus-per-task=8 "):
        assert flag in opts + " ", f"{flag!r} not in {opts}"
    slurm_run.readme_opts = opts


def test_readme_override_keeps_the_profiles_training_memory(slurm_run):
    """The README's command restates the profile's blocks, since command-line resources replace them."""
    opts = getattr(slurm_run, "readme_opts", None)
    if opts is None:
        pytest.fail("test_profile_training_submission_requests_a_gpu did not record the submission")
    assert " --mem 32000 " in opts + " ", opts


def test_cancelled_job_is_retried_by_the_profile_and_resumes(cluster, slurm_run):
    """scancel a running training job: the profile's retries resubmit it; it resumes and completes."""
    work = slurm_run.work
    label = "fedavg_long"
    config = tiny_config("slurm_cancel", {label: {"method": "fedavg"}}, rounds=400, eval_every=50, checkpoint_every=5)
    (work / "cancel.yaml").write_text(yaml.safe_dump(config))
    ckpt = work / "results" / "slurm_cancel" / "checkpoints" / "digits" / "dir" / label / "seed0.pt"
    run_dir = work / "results" / "slurm_cancel" / "runs" / "digits" / "dir" / label / "seed0"
    comment = f"rule_train_wildcards_digits_dir_{label}_0"

    proc, log = start_snakemake(cluster, work, "--configfile", "cancel.yaml", *OVERRIDES, log_name="cancel.log")
    try:
        deadline = time.time() + 400
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert ckpt.exists(), f"no checkpoint appeared:\n{log.read_text()[-4000:]}"
        queue = run(["squeue", "-h", "-o", "%i|%k|%T"], cluster.env).stdout.splitlines()
        running = [line.split("|")[0] for line in queue if line.split("|")[1] == comment]
        assert len(running) == 1, queue
        first = running[0]
        run(["scancel", first], cluster.env)
        assert not (run_dir / "metrics.json").exists(), "the job finished before it was cancelled; raise rounds"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = wait(proc, log, timeout=900)
    assert proc.returncode == 0, text[-6000:]

    jobs = [r for r in sacct(cluster) if r["Comment"] == comment]
    assert [r["JobID"] for r in jobs][0] == first
    assert jobs[0]["State"].startswith("CANCELLED") and jobs[-1]["State"] == "COMPLETED", jobs
    assert len(jobs) == 2  # one retry was enough (the profile allows 2)
    assert f"SLURM-job '{first}' failed, SLURM status is: 'CANCELLED'" in text and "Trying to restart job" in text

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["rounds"] == 400
    assert metrics["resources"]["resumed_from_round"] >= 5
    provenance = json.loads((run_dir / "provenance.json").read_text())
    assert provenance["slurm"]["SLURM_JOB_ID"] == jobs[-1]["JobID"]
    assert not ckpt.exists()  # removed once the cell completed
