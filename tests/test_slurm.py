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

A second tiny experiment (4 cells) runs through workflow/profiles/slurm-packed with 4 cells
per job group: one SLURM job with one GPU for the 4 cells, sized for cells that run one
after another (the executor plugin runs them so: one srun step per cell, in turn).

A third (4 cells) runs through workflow/scripts/pack_on_one_gpu.sbatch: one job with one
GPU in which Snakemake runs the local profile with 2 gpu_slots, so that 2 cells train side
by side; Snakemake's own records of when each cell started and ended show the overlap.

Skipped only where the SLURM packages cannot be installed (not root, no apt).
"""

from __future__ import annotations

import base64
import itertools
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
from fedrepro.planning import FALLBACK_RUNTIME_MIN

pytestmark = pytest.mark.slow

SCRIPTS = REPO / "workflow" / "scripts"
PROFILE = REPO / "workflow" / "profiles" / "slurm"
ACCOUNT = "fedrepro_test"
CPU_PART, GPU_PART = "cpu_test", "gpu_test"
EXPERIMENT = "slurm"
PACKED = REPO / "workflow" / "profiles" / "slurm-packed"
PACKED_EXPERIMENT = "slurm_packed"
PACK_SCRIPT = SCRIPTS / "pack_on_one_gpu.sbatch"
SHARED_EXPERIMENT = "slurm_gpu_share"
CELLS_PER_GPU = 2  # FEDREPRO_CELLS_PER_GPU of the script's test run (1 would run the cells in turn)

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


def start_snakemake(cluster, workdir: Path, *args: str, log_name: str,
                    profile: Path = PROFILE) -> tuple[subprocess.Popen, Path]:
    log = workdir / log_name
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--workflow-profile", str(profile), *args]
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


def snakemake(cluster, workdir: Path, *args: str, log_name: str, timeout: float = 900,
              profile: Path = PROFILE) -> tuple[int, str]:
    proc, log = start_snakemake(cluster, workdir, *args, log_name=log_name, profile=profile)
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


def start_slurm_run(cluster, work: Path) -> SimpleNamespace:
    """Start the tiny experiment (local + fedavg, 2 rounds) through the SLURM profile."""
    config = tiny_config(EXPERIMENT, {"local": {}, "fedavg": {}}, rounds=2)
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    proc, log = start_snakemake(cluster, work, "--configfile", "tiny.yaml", *OVERRIDES, log_name="run.log")
    return SimpleNamespace(work=work, config=config, proc=proc, log_path=log)


def start_packed_run(cluster, work: Path) -> SimpleNamespace:
    """Start 4 training cells (local + fedavg, seeds 0 and 1) through slurm-packed, 4 cells per group."""
    profile = yaml.safe_load((PACKED / "config.yaml").read_text())
    threads, mem_mb = 1, 1000
    # The README's override of account and partitions. --set-resources replaces the profile's
    # whole train block, so everything else in it is restated from the profile (gpu 0 per cell,
    # gres gpu:1 for the group, runtime); train gets 1 thread and 1 GB on this host, and cores
    # follows the threads, as the profile asks. train_pack=4: the 4 cells share one job.
    train = {**profile["set-resources"]["train"], "slurm_partition": GPU_PART, "mem_mb": mem_mb}
    assert profile["cores"] == profile["set-threads"]["train"]
    overrides = [
        "--default-resources", f"slurm_account={ACCOUNT}", f"slurm_partition={CPU_PART}",
        "--set-resources", *(f"train:{k}={v}" for k, v in train.items()),
        "--set-threads", f"train={threads}", "--cores", str(threads),
        "--group-components", "train_pack=4",
        "--slurm-init-seconds-before-status-checks", "2", "--slurm-keep-successful-logs", "--verbose",
    ]
    config = {**tiny_config(PACKED_EXPERIMENT, {"local": {}, "fedavg": {}}, rounds=2), "seeds": [0, 1]}
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    proc, log = start_snakemake(cluster, work, "--configfile", "tiny.yaml", *overrides, log_name="packed.log",
                                profile=PACKED)
    return SimpleNamespace(work=work, config=config, proc=proc, log_path=log, threads=threads, mem_mb=mem_mb)


def start_cost_run(cluster, work: Path) -> SimpleNamespace:
    """Start the time-limit test's experiment (see test_training_time_limits_follow_each_cells_estimate)
    with its made-up calibration, and each cell's expected time limit, computed before it starts."""
    from fedrepro import calibration, planning
    from fedrepro.config import resolve_experiment

    config = tiny_config("slurm_cost", {"fedavg": {}, "ditto": {}, "fedavg_9_rounds": {"method": "fedavg",
                         "training": {"rounds": 9}}}, rounds=3)
    config["partitions"] = {"dir": {"partitioner": "iid", "num_clients": 3, "seed": 0}}
    (work / "cost.yaml").write_text(yaml.safe_dump(config))
    exp = resolve_experiment(config)
    spec = calibration.model_spec(exp["cells"][0], exp["datasets"])
    root = work / calibration.CALIBRATION_DIR
    path = calibration.calibration_path("cpu: made up", 1, "0", root)
    calibration.save_entry(path, {"device": "cpu: made up", "threads": 1, "torch": "0", "startup_s": 30.0}, spec.key,
                           {"train_step_s": 2.0, "forward_sample_s": 1e-6, "head_step_s": 1e-2})
    shards = work / "results" / "shards"
    limits = planning.RuntimeLimits(exp, calibration_root=root, environ={}, shards_root=shards)
    expected = {c["label"]: limits.minutes("train", c, threads=1) for c in exp["cells"]}
    proc, log = start_snakemake(cluster, work, "--configfile", "cost.yaml", *OVERRIDES, log_name="cost.log")
    return SimpleNamespace(work=work, exp=exp, root=root, shards=shards, expected=expected, proc=proc, log_path=log)


@pytest.fixture(scope="module")
def started(cluster, tmp_path_factory):
    """The module's three independent workflow runs (the tiny experiment, the packed one and the
    time-limit one), started together once the cluster is up: each has its own working folder,
    run name and cells, and their jobs queue on the one node as any users' jobs would. Most of a
    run's time is waiting (job start-up, status checks), which the three then share."""
    runs = {"slurm": start_slurm_run(cluster, tmp_path_factory.mktemp("slurm_wf"))}
    try:
        runs["packed"] = start_packed_run(cluster, tmp_path_factory.mktemp("slurm_packed_wf"))
        runs["cost"] = start_cost_run(cluster, tmp_path_factory.mktemp("slurm_cost_wf"))
        yield runs
    finally:
        for r in runs.values():
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()


@pytest.fixture(scope="module")
def slurm_run(started, cluster, tmp_path_factory):
    """The tiny experiment (local + fedavg, 2 rounds) run through the SLURM profile. Once it has
    finished, the failing forced retrain of one of its cells starts in a copy (see
    test_failed_forced_retrain_keeps_the_earlier_result): it waits on SLURM meanwhile."""
    r = started["slurm"]
    text = wait(r.proc, r.log_path, timeout=900)
    assert r.proc.returncode == 0, f"the SLURM run failed:\n{text[-6000:]}"
    names = set(re.findall(r"^sbatch call: sbatch --parsable --job-name (\S+)", text, re.M))
    assert len(names) == 1, names  # one name (fedrepro_<run uuid>) for all jobs of a run
    run = SimpleNamespace(work=r.work, config=r.config, log=text, jobname=names.pop())
    run.forced = started["forced"] = start_forced_retrain(cluster, run, tmp_path_factory.mktemp("slurm_forced"))
    return run


@pytest.fixture(scope="module")
def packed_run(started):
    """4 training cells (local + fedavg, seeds 0 and 1) through slurm-packed, 4 cells per group."""
    r = started["packed"]
    text = wait(r.proc, r.log_path, timeout=900)
    assert r.proc.returncode == 0, f"the slurm-packed run failed:\n{text[-6000:]}"
    names = set(re.findall(r"^sbatch call: sbatch --parsable --job-name (\S+)", text, re.M))
    assert len(names) == 1, names
    # no calibration in this working folder: each cell asks for the fixed limit of before (docs/cost.md)
    return SimpleNamespace(work=r.work, config=r.config, log=text, jobname=names.pop(), threads=r.threads,
                           mem_mb=r.mem_mb, runtime=FALLBACK_RUNTIME_MIN["train"])


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


def test_training_time_limits_follow_each_cells_estimate(cluster, started):
    """With a calibration in the workflow's results/.calibration/ at the jobs' threads, every training
    job is submitted with its own time limit, the planning's estimate x margin + floor (docs/cost.md):
    Ditto's cells (two models a batch) and FedAvg's of 3 and 9 rounds ask for different limits, and
    sacct records them. The calibration's numbers are made up (seconds a step) so that the cells'
    estimates are minutes apart; the cells themselves train in seconds. An iid partition: its clients'
    sizes are the estimate's before the shards exist and the manifest's after, to the step (Snakemake
    may ask for the limits before or after partitioning)."""
    from fedrepro import planning

    r = started["cost"]  # config, calibration and expected limits written before its run started
    exp, root, shards, expected, tmp_path = r.exp, r.root, r.shards, r.expected, r.work
    assert len(set(expected.values())) == 3, expected  # the three cells' estimates differ

    text = wait(r.proc, r.log_path, timeout=900)
    assert r.proc.returncode == 0, text[-6000:]
    calls = {re.search(r"--comment rule_train_wildcards_digits_dir_(\w+?)_0", c).group(1): submitted(c)
             for c in sbatch_calls(text, "train")}
    assert sorted(calls) == sorted(expected), calls
    jobids = {}
    for label, minutes in expected.items():
        assert f" -t {minutes} " in calls[label] + " ", (label, minutes, calls[label])
        run_dir = tmp_path / "results" / "slurm_cost" / "runs" / "digits" / "dir" / label / "seed0"
        jobids[label] = json.loads((run_dir / "provenance.json").read_text())["slurm"]["SLURM_JOB_ID"]
    rows = {r["JobID"]: r for r in sacct(cluster, *jobids.values())}
    for label, jobid in jobids.items():
        m = expected[label]
        assert rows[jobid]["Timelimit"] == f"{m // 60:02d}:{m % 60:02d}:00", (label, rows[jobid])
    after = planning.RuntimeLimits(exp, calibration_root=root, environ={}, shards_root=shards)
    from fedrepro.cost import Estimator

    assert Estimator(exp, shards).sizes("digits", "dir").source == "manifest"
    assert {c["label"]: after.minutes("train", c, threads=1) for c in exp["cells"]} == expected


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
    overridden): -p gpu, --gpus=1, 8 CPUs, 32000 MB, 240 min (no calibration here: the fixed
    limit). No partition 'gpu' here, so sbatch refuses it; the plugin logs the call either way.
    Then with the README's override of the partitions: still --gpus=1 and 8 CPUs; on this host
    the job exceeds the node (EnforcePartLimits=ALL refuses it) unless the node has 8 CPUs.
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
                        "train:mem_mb=32000", *common, log_name="readme.log", timeout=600)
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


def test_packed_profile_runs_four_cells_in_one_slurm_job_with_one_gpu(cluster, packed_run):
    config, work = packed_run.config, packed_run.work
    cells = [(label, seed) for label in config["methods"] for seed in config["seeds"]]
    assert len(cells) == 4
    jobids = {}
    for label, seed in cells:
        run_dir = work / "results" / PACKED_EXPERIMENT / "runs" / "digits" / "dir" / label / f"seed{seed}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "ok" and metrics["rounds"] == 2
        provenance = json.loads((run_dir / "provenance.json").read_text())
        assert provenance["slurm"]["SLURM_JOB_PARTITION"] == GPU_PART
        # The cell asks for no GPU of its own (gpu 0), yet its srun step gets the job's GPU
        # (here a placeholder: CUDA_VISIBLE_DEVICES is set, the cell runs on the CPU).
        assert provenance["device"]["cuda_visible_devices"] is not None, provenance["device"]
        jobids[(label, seed)] = provenance["slurm"]["SLURM_JOB_ID"]
    assert len(set(jobids.values())) == 1, f"4 cells, 4 per group: one SLURM job expected, got {jobids}"
    jobid = jobids[cells[0]]

    # One submission for the 4 cells, no per-cell submissions; the GPU is requested once (gres).
    calls = sbatch_calls(packed_run.log, "train")  # also matches the group's comment rule_train_pack_train
    assert len(calls) == 1, calls
    opts = submitted(calls[0]) + " "
    n = len(cells)
    for flag in (" --comment rule_train_pack_train ", " --gres=gpu:1 ", f" -p {GPU_PART} ", f" -A {ACCOUNT} ",
                 f" --cpus-per-task={packed_run.threads} ", f" --mem {packed_run.mem_mb} ", f" -t {n * packed_run.runtime} "):
        assert flag in opts, f"{flag!r} not in {opts}"
    assert "--gpus" not in opts, opts

    row = {r["JobID"]: r for r in sacct(cluster, jobid)}[jobid]
    assert row["State"] == "COMPLETED" and row["Partition"] == GPU_PART and row["Account"] == ACCOUNT
    assert row["Comment"] == "rule_train_pack_train" and row["JobName"] == packed_run.jobname
    t = tres(row)
    # ONE GPU for the group, not one per cell; one cell's CPUs and memory, since the cells run
    # in turn (below); the time limit is the sum of the cells' runtimes (4 x 240 min).
    assert t["gres/gpu"] == "1", row["AllocTRES"]
    assert t["cpu"] == str(packed_run.threads) and t["mem"] == f"{packed_run.mem_mb}M", row["AllocTRES"]
    minutes = n * packed_run.runtime
    assert row["Timelimit"] == f"{minutes // 60:02d}:{minutes % 60:02d}:00", row["Timelimit"]
    train_rows = [r for r in sacct(cluster) if r["JobName"] == packed_run.jobname and r["Comment"].startswith("rule_train")]
    assert [r["JobID"] for r in train_rows] == [jobid]

    # Inside the job the plugin runs Snakemake with --jobs 1: one srun step per cell, each
    # started when the previous one has ended (one after another, not side by side), and
    # each step holds the job's GPU.
    fields = ["JobID", "State", "AllocTRES", "Start", "End"]
    out = run(["sacct", "-j", jobid, "--parsable2", "--noheader", "--format", ",".join(fields)], cluster.env).stdout
    steps = [dict(zip(fields, line.split("|"))) for line in out.splitlines()]
    steps = [s for s in steps if re.fullmatch(rf"{jobid}\.\d+", s["JobID"])]
    assert len(steps) == n, steps
    assert all(s["State"] == "COMPLETED" and tres(s)["gres/gpu"] == "1" for s in steps), steps
    spans = sorted((s["Start"], s["End"]) for s in steps)  # ISO 8601 times sort as text
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), f"cells overlapped: {spans}"

    table = (work / "results" / PACKED_EXPERIMENT / "tables" / "accuracy.md").read_text()
    assert "fedavg" in table and "local" in table


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


def start_forced_retrain(cluster, slurm_run: SimpleNamespace, work: Path) -> SimpleNamespace:
    """Start test_failed_forced_retrain_keeps_the_earlier_result's run in `work`: a copy of the finished
    run's data and its fedavg cell, retrained with --forcerun in a job that fails."""
    label = "fedavg"
    cell = Path("results", EXPERIMENT, "runs", "digits", "dir", label, "seed0")
    for sub in ("raw", "shards"):
        shutil.copytree(slurm_run.work / "results" / sub, work / "results" / sub)
    shutil.copytree(slurm_run.work / cell, work / cell)
    earlier = {name: (work / cell / name).read_bytes() for name in ("metrics.json", "provenance.json")}
    (work / "results" / EXPERIMENT / "checkpoints" / "digits" / "dir" / label / "seed0.pt").mkdir(parents=True)
    (work / "tiny.yaml").write_text(yaml.safe_dump({**slurm_run.config, "methods": {label: {}}}))
    proc, log = start_snakemake(cluster, work, "--configfile", "tiny.yaml", *OVERRIDES, "--forcerun", "train",
                                "--retries", "0", log_name="forced.log")
    return SimpleNamespace(work=work, label=label, cell=cell, earlier=earlier, proc=proc, log_path=log)


def test_failed_forced_retrain_keeps_the_earlier_result(cluster, slurm_run):
    """A cell the SLURM run finished, retrained with --forcerun train in a job that fails: its
    metrics.json and provenance.json are still there, byte for byte. Train's outputs are update():
    the cell's Snakemake on the node backs them up and puts them back; the sbatch job's Snakemake and
    the main one then find no backup and, without the profile's keep-incomplete, delete them.
    The job fails for certain: a directory where the cell's checkpoint goes (`fedrepro train` exits 2).
    In a copy of the run's data and that one cell, so the run's own results stay as they are; one
    try (each of the profile's retries would go the same way)."""
    r = slurm_run.forced  # started in a copy (start_forced_retrain) once the run had finished
    label, cell, earlier, tmp_path = r.label, r.cell, r.earlier, r.work
    text = wait(r.proc, r.log_path, timeout=900)
    assert r.proc.returncode != 0, text[-6000:]
    failures = re.findall(r"^Error in rule train:\n\s+message: SLURM-job '\d+' failed.*\n\s+jobid: \d+\n.*\n"
                          rf"\s+output: {re.escape(str(cell / 'metrics.json'))} \(update\)", text, re.M)
    assert len(failures) == 1, text[-6000:]
    train_log = tmp_path / "results" / EXPERIMENT / "logs" / "train" / "digits" / "dir" / label / "seed0.log"
    assert "--checkpoint: an existing directory" in train_log.read_text()
    for name, data in earlier.items():
        path = tmp_path / cell / name
        assert path.is_file() and path.read_bytes() == data, f"the failed retrain lost {name}"


def job_times(work: Path) -> dict[str, tuple[float, float]]:
    """Start and end (epoch seconds) of the job that made each output, as Snakemake records them.

    .snakemake/metadata/<urlsafe base64 of the path> (long names split into '@'-prefixed
    folders) holds `starttime`, when the job's incomplete marker was written as it started,
    and `endtime`, the output's mtime once it ended (snakemake/persistence).
    """
    root = work / ".snakemake" / "metadata"
    times = {}
    for path in root.rglob("*"):
        if path.is_file():
            key = "".join(part.lstrip("@") for part in path.relative_to(root).parts)
            record = json.loads(path.read_text())
            times[base64.urlsafe_b64decode(key).decode()] = (record["starttime"], record["endtime"])
    return times


def test_script_trains_cells_side_by_side_on_one_gpu_in_one_slurm_job(cluster, tmp_path):
    """4 cells in one sbatch of workflow/scripts/pack_on_one_gpu.sbatch, 2 at a time on its one GPU."""
    work = tmp_path / "work"
    work.mkdir()
    config = {**tiny_config(SHARED_EXPERIMENT, {"local": {}, "fedavg": {}}, rounds=20, eval_every=5,
                            checkpoint_every=5), "seeds": [0, 1]}
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    env = {**cluster.env, "FEDREPRO_CELLS_PER_GPU": str(CELLS_PER_GPU)}
    env.pop("FEDREPRO_REPO", None)  # found from where sbatch is called: the repository root
    # 2 CPUs for 2 cells of 1 thread; the job's defaults (8 CPUs, 32G, 24 h) do not fit this host.
    proc = run(["sbatch", "--parsable", "--wait", "-p", GPU_PART, "-A", ACCOUNT, "--cpus-per-task=2", "--mem=3000",
                "-t", "10", f"--chdir={work}", f"--output={work}/pack-%j.out", PACK_SCRIPT,
                "--configfile", "tiny.yaml", "--set-threads", "train=1"],
               env, timeout=600, check=False, cwd=REPO)
    out = next(work.glob("pack-*.out"), None)
    job_log = out.read_text() if out else "(no job output)"
    assert proc.returncode == 0, f"sbatch failed ({proc.returncode}):\n{proc.stderr}\n{job_log[-6000:]}"
    jobid = proc.stdout.strip().split(";")[0]
    assert f"pack_on_one_gpu: job {jobid} " in job_log and f"up to {CELLS_PER_GPU} cells at once" in job_log, job_log[:2000]

    cells = [(label, seed) for label in config["methods"] for seed in config["seeds"]]
    spans = {}
    times = job_times(work)
    for label, seed in cells:
        rel = f"results/{SHARED_EXPERIMENT}/runs/digits/dir/{label}/seed{seed}"
        metrics = json.loads((work / rel / "metrics.json").read_text())
        assert metrics["status"] == "ok" and metrics["rounds"] == 20, metrics["status"]
        provenance = json.loads((work / rel / "provenance.json").read_text())
        slurm = provenance["slurm"]
        assert slurm["SLURM_JOB_ID"] == jobid and slurm["SLURM_JOB_PARTITION"] == GPU_PART, slurm  # one job, 4 cells
        assert provenance["device"]["cuda_visible_devices"] is not None, provenance["device"]  # the job's GPU
        spans[f"{label}/seed{seed}"] = times[f"{rel}/metrics.json"]

    row = {r["JobID"]: r for r in sacct(cluster, jobid)}[jobid]
    assert row["State"] == "COMPLETED" and row["Partition"] == GPU_PART and row["Account"] == ACCOUNT, row
    t = tres(row)
    assert t["gres/gpu"] == "1" and t["cpu"] == "2", row["AllocTRES"]  # ONE GPU for the 4 cells

    out_dir = work / "results" / SHARED_EXPERIMENT
    assert (out_dir / "summary.csv").exists()
    table = (out_dir / "tables" / "accuracy.md").read_text()
    assert "fedavg" in table and "local" in table

    # Side by side: some cells' runs overlap in time; never more than the job's gpu_slots at once.
    t0 = min(start for start, _ in spans.values())
    shown = {cell: (round(a - t0, 2), round(b - t0, 2)) for cell, (a, b) in sorted(spans.items(), key=lambda kv: kv[1])}
    print(f"cells of job {jobid} (start, end in s after the first start): {shown}")
    overlaps = {(a, b): min(spans[a][1], spans[b][1]) - max(spans[a][0], spans[b][0])
                for a, b in itertools.combinations(spans, 2)}
    assert max(overlaps.values()) > 1.0, f"no two cells ran side by side: {shown}"
    for cell, (start, _) in spans.items():
        running = [c for c, (a, b) in spans.items() if a <= start < b]
        assert len(running) <= CELLS_PER_GPU, f"{running} ran at once, above {CELLS_PER_GPU} gpu_slots: {shown}"


def test_readme_laptop_command_fits_a_two_cpu_slurm_up_node():
    """The README's command for trying the profile on `slurm_up.sh`'s one-node cluster: its
    account and partitions are the script's defaults, and every training job fits a 2-CPU node
    (the profile's 8 CPUs per job do not: sbatch refuses them), so it runs as written."""
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S)
                 if "--configfile config/test.yaml" in b and "workflow/profiles/slurm " in b)
    args = block.replace("\\\n", " ").split()
    script = (SCRIPTS / "slurm_up.sh").read_text()
    account = re.search(r"^ACCOUNT=(\S+)", script, re.M).group(1)
    partitions = re.search(r'^PARTITIONS="([^"]+)"', script, re.M).group(1).split()
    assert f"slurm_account={account}" in args and f"slurm_partition={partitions[0]}" in args
    assert f"train:slurm_partition={partitions[1]}" in args
    threads = int(args[args.index("--set-threads") + 1].removeprefix("train="))
    assert 1 <= threads <= 2
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert profile["set-threads"]["train"] > 2  # the profile's own size would not fit: the command must say it
    assert max(int(a.split("=")[1]) for a in args if a.split("=")[0].endswith("mem_mb")) <= 4000
