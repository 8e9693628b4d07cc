"""The local profile sizes itself from the machine (issue 38): src/fedrepro/local_plan.py plans
the training cells at once (`gpu_slots`) and their threads from the cores, the visible GPUs'
free memory and the available memory; workflow/profiles/local renders that plan, says it once
on stderr, and the command line still wins."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from fedrepro import local_plan
from fedrepro.local_plan import CELL_GPU_MIB, CPU_CELL_THREADS, MAX_CELLS_PER_GPU, TRAINING_RULES, plan, visible_gpus

PROFILE = REPO / "workflow" / "profiles" / "local"
GIB = 1024


# ------------------------------------------------------------------ the plan (pure)


def test_without_gpu_cells_run_side_by_side_at_two_threads_bounded_by_cores():
    p = plan(cores=32, gpus_free_mib=[])
    assert p.gpu_slots is None and p.resources() is None  # no slot limit: --cores bounds the cells
    # the threads every cell trained at before the plan existed: the same numbers as recorded
    assert p.threads == CPU_CELL_THREADS == 2 and p.set_threads() == {rule: 2 for rule in TRAINING_RULES}
    assert "no GPU" in p.line and "as many as --cores allows (16 at once with all 32 cores)" in p.line and "2 threads each" in p.line
    small = plan(cores=2, gpus_free_mib=[])  # the quick start's machine: one 2-thread cell at a time, said so
    assert small.gpu_slots is None and "as many as --cores allows (1 at once with all 2 cores), 2 threads each" in small.line
    # available memory caps it (2 GiB a cell), never the cores of this machine: --cores 8 on 2 cores
    assert plan(cores=2, gpus_free_mib=[], host_free_mib=64 * GIB).gpu_slots == 32
    capped = plan(cores=32, gpus_free_mib=[], host_free_mib=12 * GIB)
    assert capped.gpu_slots == 6 and "at most 6 at once (memory: 12 GiB available" in capped.line
    assert plan(cores=2, gpus_free_mib=[], host_free_mib=1 * GIB).gpu_slots == 1


def test_one_gpu_packs_cells_by_free_memory_up_to_the_cap():
    big = plan(cores=16, gpus_free_mib=[80 * GIB])
    assert big.gpu_slots == MAX_CELLS_PER_GPU == 8 and big.threads == 2  # 8 cells x 2 threads fit 16 cores
    assert big.resources() == {"gpu_slots": 8} and "1 GPU (80 GiB free)" in big.line
    assert plan(cores=16, gpus_free_mib=[6 * GIB]).gpu_slots == 6 * GIB // CELL_GPU_MIB == 3
    full = plan(cores=16, gpus_free_mib=[500])  # no room for a cell: still one at a time, not none
    assert full.gpu_slots == 1 and "one at a time" in full.line
    assert plan(cores=4, gpus_free_mib=[80 * GIB]).threads == 1  # 8 cells on 4 cores: 1 thread each
    assert plan(cores=16, gpus_free_mib=[None]).gpu_slots == 1  # a MIG instance, memory unknown


def test_four_gpus_add_up_their_cells_and_share_the_cores():
    p = plan(cores=16, gpus_free_mib=[80 * GIB, 80 * GIB, 40 * GIB, 1 * GIB])
    assert p.gpu_slots == 8 + 8 + 8 + 0 and p.threads == 1  # 24 cells on 16 cores
    assert "4 GPUs (80, 80, 40, 1 GiB free)" in p.line and "8+8+8+0" in p.line
    wide = plan(cores=64, gpus_free_mib=[80 * GIB] * 4)
    assert wide.gpu_slots == 32 and wide.threads == 2
    assert plan(cores=64, gpus_free_mib=[80 * GIB] * 4, host_free_mib=20 * GIB).gpu_slots == 10  # host memory binds


def test_environment_overrides_replace_the_plan():
    p = plan(cores=16, gpus_free_mib=[80 * GIB], slots=3, threads=4)
    assert p.resources() == {"gpu_slots": 3} and p.threads == 4
    assert "(FEDREPRO_GPU_SLOTS)" in p.line and "(FEDREPRO_TRAIN_THREADS)" in p.line
    assert plan(cores=16, gpus_free_mib=[80 * GIB], slots=16).threads == 1  # threads follow the slots asked for


@pytest.mark.parametrize("name,value", [("FEDREPRO_GPU_SLOTS", "many"), ("FEDREPRO_TRAIN_THREADS", "0"),
                                        ("FEDREPRO_GPU_SLOTS", "-2"), ("FEDREPRO_TRAIN_THREADS", "99999"),
                                        ("FEDREPRO_GPU_SLOTS", "9" * 5000), ("FEDREPRO_GPU_SLOTS", "²")])
def test_a_bad_override_variable_stops_with_one_line(name, value, capsys):
    with pytest.raises(SystemExit) as exc:
        local_plan.profile_plan({name: value})
    message = str(exc.value)
    assert message.startswith(f"fedrepro: local profile: environment variable {name} has value '{value[:10]}")
    assert message.endswith("; allowed: a whole number from 1 to 4096") and len(message) < 300
    assert capsys.readouterr().err == ""  # nothing planned, nothing said


def test_cuda_visible_devices_selects_gpus_as_cuda_does():
    rows = [("0", "GPU-aaaa-1111", 1000), ("1", "GPU-bbbb-2222", 2000), ("2", "GPU-cccc-3333", 3000)]
    assert visible_gpus(rows, None) == [1000, 2000, 3000]
    assert visible_gpus(rows, "") == [] and visible_gpus(rows, "-1") == []
    assert visible_gpus(rows, "2,0") == [3000, 1000]
    assert visible_gpus(rows, "GPU-bbbb") == [2000]
    assert visible_gpus(rows, "1,7,2") == [2000]  # CUDA stops at the first entry naming no GPU
    assert visible_gpus(rows, "MIG-0123") == [None]


def fake_nvidia_smi(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def test_gpu_query_reads_nvidia_smi_and_survives_its_absence_and_hangs(tmp_path, monkeypatch):
    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert local_plan.query_gpus() == ([], "")  # no nvidia-smi: no GPU
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "ok", 'echo "0, GPU-aa, 81000"; echo "1, GPU-bb, [N/A]"')))
    assert local_plan.query_gpus() == ([("0", "GPU-aa", 81000), ("1", "GPU-bb", None)], "")
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "nodev", 'echo "No devices were found"; exit 6')))
    assert local_plan.query_gpus() == ([], "")
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "hang", f"exec {sleep} 30")))
    assert local_plan.query_gpus(timeout=0.3) == ([], " (nvidia-smi timed out after 0.3 s; planning without a GPU)")


FLOOD = f"exec {shutil.which('yes')} '0, GPU-aa, 81000'"  # an nvidia-smi that prints without end
NOT_UTF8 = r"printf '0, GPU-\377\376, 81000\n'"  # sh's printf: octal bytes 0xff 0xfe
# what the query costs, in a fresh interpreter: its peak memory (VmHWM: ru_maxrss would count pytest's, kept across exec)
MEASURE = ("import json, re, sys, time; from fedrepro.local_plan import query_gpus; t = time.monotonic(); "
           "rows, note = query_gpus(timeout=float(sys.argv[1])); seconds = time.monotonic() - t; "
           "peak = int(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)); "
           "print(json.dumps([rows, note, seconds, peak]))")


def test_a_flooding_nvidia_smi_is_stopped_by_its_size_and_named(tmp_path):
    """Before (issue 46): the query read all it printed until the timeout, 8.9 GB in 12 s. Now it
    stops at 1 MiB, kills it and plans without a GPU, saying why."""
    env = {**os.environ, "PATH": str(fake_nvidia_smi(tmp_path / "flood", FLOOD))}
    out = subprocess.run([sys.executable, "-c", MEASURE, "4"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rows, note, seconds, peak_kib = json.loads(out.stdout)
    assert rows == [] and note == " (nvidia-smi printed more than 1 MiB; planning without a GPU)"
    assert seconds < 4  # stopped by its size, not its time
    assert peak_kib < 200 * 1024, f"peak memory {peak_kib // 1024} MiB"


def test_a_hanging_or_non_utf8_nvidia_smi_gives_the_no_gpu_plan_naming_it(tmp_path, monkeypatch):
    left = tmp_path / "still-running"  # written by what the hanging nvidia-smi started, were it left running
    hang = fake_nvidia_smi(tmp_path / "hang", f"(sleep 1; touch {left}) & sleep 30")
    monkeypatch.setenv("PATH", f"{hang}{os.pathsep}{os.path.dirname(shutil.which('sleep'))}")
    assert local_plan.query_gpus(timeout=0.3) == ([], " (nvidia-smi timed out after 0.3 s; planning without a GPU)")
    time.sleep(1.5)
    assert not left.exists()  # killed with everything it started
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "bytes", NOT_UTF8)))
    assert local_plan.query_gpus() == ([], " (nvidia-smi printed output that is not UTF-8 (byte 7); planning without a GPU)")


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   21000000 kB\n")
    assert local_plan.available_memory_mib(str(meminfo)) == 21000000 // 1024
    assert local_plan.available_memory_mib(str(tmp_path / "absent")) is None


# ------------------------------------------------------------------ the rendered profile


def parse_profile(*args: str):
    """Snakemake's own parsing of the command line with the local profile (as `snakemake` does),
    its config reader put back afterwards (the profile installs fedrepro's guard)."""
    import snakemake.common.configfile as cf
    import snakemake.settings.types as st
    from snakemake.cli import parse_args

    saved = cf.load_configfile, st.load_configfile
    try:
        return parse_args(["-s", str(REPO / "Snakefile"), "-n", "--workflow-profile", str(PROFILE), *args])[1]
    finally:
        cf.load_configfile, st.load_configfile = saved


def values(resources) -> dict:
    return {name: r.value for name, r in resources.items()}


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This process as a machine with 2 GPUs of 10 GiB free (a fake nvidia-smi) and 30 GiB of memory."""
    monkeypatch.setattr(local_plan, "_said", False)
    for name in ("CUDA_VISIBLE_DEVICES", "FEDREPRO_GPU_SLOTS", "FEDREPRO_TRAIN_THREADS"):
        monkeypatch.delenv(name, raising=False)
    smi = fake_nvidia_smi(tmp_path / "bin", 'echo "0, GPU-aa, 10240"; echo "1, GPU-bb, 10240"')
    monkeypatch.setenv("PATH", f"{smi}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(local_plan, "available_memory_mib", lambda: 30 * GIB)
    return monkeypatch


def test_profile_renders_the_plan_and_says_it_once(machine, capsys):
    args = parse_profile()
    expected = plan(local_plan.usable_cores(), [10 * GIB, 10 * GIB], 30 * GIB)
    assert expected.gpu_slots == 10  # 5 + 5 cells (2 GiB each) on the two GPUs
    assert values(args.resources) == {"gpu_slots": 10}
    assert values(args.set_threads) == {rule: expected.threads for rule in TRAINING_RULES}
    assert isinstance(args.cores, int) and args.keep_going and args.rerun_incomplete  # the rest as before
    err = capsys.readouterr().err
    assert err.count("fedrepro: local profile:") == 1 and expected.line in err
    parse_profile()  # read again by the same process: not said again
    assert "fedrepro: local profile:" not in capsys.readouterr().err


def test_no_gpu_profile_leaves_cells_to_cores(machine, capsys):
    machine.setenv("CUDA_VISIBLE_DEVICES", "")
    args = parse_profile("--cores", "8")
    assert values(args.resources) == {"gpu_slots": 15}  # 30 GiB at 2 GiB a cell: not the limit at --cores 8
    assert values(args.set_threads) == {rule: 2 for rule in TRAINING_RULES} and args.cores == 8
    assert "no GPU; training cells run side by side" in capsys.readouterr().err


def test_command_line_and_environment_win_over_the_plan(machine, capsys):
    args = parse_profile("--resources", "gpu_slots=3", "--set-threads", "train=4")
    assert values(args.resources) == {"gpu_slots": 3} and values(args.set_threads) == {"train": 4}
    machine.setattr(local_plan, "_said", False)
    machine.setenv("FEDREPRO_GPU_SLOTS", "2")
    machine.setenv("FEDREPRO_TRAIN_THREADS", "3")
    args = parse_profile()
    assert values(args.resources) == {"gpu_slots": 2} and values(args.set_threads) == {rule: 3 for rule in TRAINING_RULES}
    assert "at most 2 at once (FEDREPRO_GPU_SLOTS), 3 threads each (FEDREPRO_TRAIN_THREADS)" in capsys.readouterr().err


def test_a_misbehaving_nvidia_smi_leaves_the_profile_planning_without_a_gpu(machine, tmp_path, capsys):
    machine.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'flood', FLOOD)}{os.pathsep}{os.environ['PATH']}")
    args = parse_profile("--cores", "8")
    assert values(args.set_threads) == {rule: CPU_CELL_THREADS for rule in TRAINING_RULES}  # the no-GPU plan
    assert ("no GPU (nvidia-smi printed more than 1 MiB; planning without a GPU); training cells run side by side"
            in capsys.readouterr().err)


def snakemake_env(**extra: str) -> dict:
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **extra}


def test_snakemake_says_the_plan_once_before_it_plans(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--workflow-profile", str(PROFILE), "--configfile", str(REPO / "config" / "test.yaml")],
                          cwd=tmp_path, env=snakemake_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedrepro: local profile:")]
    assert len(lines) == 1 and "no GPU; training cells run side by side" in lines[0], proc.stderr[-3000:]
    assert "fedrepro: local profile:" not in proc.stdout and "Building DAG" in proc.stdout + proc.stderr


def test_snakemake_reads_the_profile_when_nvidia_smi_prints_non_utf8(tmp_path):
    """Before (issue 46): "Couldn't parse config file ... UnicodeDecodeError", blaming the profile."""
    smi = fake_nvidia_smi(tmp_path / "bin", NOT_UTF8)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--workflow-profile", str(PROFILE), "--configfile", str(REPO / "config" / "test.yaml")],
                          cwd=tmp_path, env=snakemake_env(PATH=f"{smi}{os.pathsep}{snakemake_env()['PATH']}"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedrepro: local profile:")]
    assert len(lines) == 1 and lines[0].startswith("fedrepro: local profile: no GPU (nvidia-smi printed output that is "
                                                   "not UTF-8 (byte 7); planning without a GPU); "), proc.stderr[-3000:]


def test_profile_file_asks_the_plan_after_the_guard():
    definitions = yaml.safe_load(PROFILE.joinpath("config.yaml").read_text())["__definitions__"]
    assert definitions[:2] == ["from fedrepro.snakemake_guard import install", "install()"]
    assert any("profile_plan()" in line for line in definitions[2:])


# ------------------------------------------------------------------ a larger machine, simulated


@pytest.mark.slow
def test_with_cores_8_and_no_gpu_cells_train_side_by_side(tmp_path):
    """4 tiny cells with the local profile and `--cores 8` on this (2-core) machine, no GPU
    visible: they train at once, 2 threads each (4 at once), and the plan is said once for the whole run."""
    from test_faults import tiny_config
    from test_slurm import job_times

    config = tiny_config("sidebyside", methods={"fedavg": {}, "local": {}}, rounds=2)
    config["seeds"] = [0, 1]
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "--workflow-profile", str(PROFILE), "--configfile", "exp.yaml", "--cores", "8", "aggregate"],
                          cwd=tmp_path, env=snakemake_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert text.count("fedrepro: local profile:") == 1, text[-4000:]  # the jobs do not say it again
    runs = sorted((tmp_path / "results" / "sidebyside" / "runs").glob("*/*/*/seed*"))
    assert len(runs) == 4
    times = job_times(tmp_path)
    spans = {str(run.relative_to(tmp_path)): times[f"{run.relative_to(tmp_path)}/metrics.json"] for run in runs}
    for run in runs:
        provenance = yaml.safe_load((run / "provenance.json").read_text())
        assert provenance["torch"]["num_threads"] == CPU_CELL_THREADS, run
        assert "fedrepro: local profile" not in (tmp_path / "results" / "sidebyside" / "logs" / "train").joinpath(
            *run.relative_to(tmp_path / "results" / "sidebyside" / "runs").parts[:-1], f"{run.name}.log").read_text()
    t0 = min(start for start, _ in spans.values())
    shown = {cell: (round(a - t0, 2), round(b - t0, 2)) for cell, (a, b) in sorted(spans.items(), key=lambda kv: kv[1])}
    at_once = max(sum(1 for a, b in spans.values() if a <= start < b) for start, _ in spans.values())
    overlap = max(min(spans[x][1], spans[y][1]) - max(spans[x][0], spans[y][0]) for x, y in itertools.combinations(spans, 2))
    assert at_once >= 2 and overlap > 0.5, f"the cells ran one after another: {shown}"
