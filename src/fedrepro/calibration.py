"""How fast this machine trains each model an experiment uses: measured once, cached, read by the cost model.

`fedrepro calibrate CONFIG` times, for every distinct `ModelSpec` of the experiment's cells (the model
with its parameters, the input shape, the classes, the training batch size and the weight layout), a
few training steps (forward, backward and an SGD step on a random batch), forward passes without
gradient (evaluation, features) and steps of the head alone (fine-tuning on cached features), on the
device the cells would run on and at their thread count, and a job's start-up (a whole `fedrepro train`
job that trains next to nothing). The results are seconds per step (per sample for forwards), cached as one
JSON file per (device name, threads, torch version) under `CALIBRATION_DIR`, written atomically;
fedrepro.cost turns a cell's work into seconds with them (docs/cost.md).

A step too slow to time at the cell's batch size within the budget (ResNet-18 at batch 256 on a
2-core CPU) is timed at a smaller batch and scaled linearly to it ("train_batch" in the cache says
which): per-sample cost falls with the batch, so the scaled value errs on the long side. A model
that loads pre-trained weights (prompted_vit's `weights`) is timed with random ones: the values
change no time. Timings on a busy machine are too long by the load: calibrate an idle one.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .bounded_run import ProgramFailed, run_bounded
from .io import canonical_json, load_json, read_json, write_json_atomic
from .kernels import cpu_name  # noqa: F401  (calibrations are keyed by it; callers import it from here)
from .registry import ConfigError, show

#: Where calibrations are cached, relative to the working directory (the workflow's): one file per
#: device, threads and torch version. Never under version control (results/.gitignore).
CALIBRATION_DIR = Path("results") / ".calibration"
FORMAT = "fedrepro-calibration/1"
#: Largest calibration file read (a few hundred models of a few numbers each).
MAX_FILE_BYTES = 1 << 20
#: Seconds of timing aimed at per measured quantity (training, forwards); a slower step is timed at
#: a smaller batch (see the module's docstring). Chosen so that every model of the shipped configs
#: calibrates in well under a minute on a 2-core CPU (docs/cost.md lists the measured times).
BUDGET_S = 1.5
#: Forward batches are timed at most this large (evaluation runs at eval_batch_size, 1024 by default;
#: per sample, larger batches cost about the same).
FORWARD_BATCH = 256
#: Batch of the timed head steps (the fine-tuning recipes' 32).
HEAD_BATCH = 32
#: A machine busier than this (1-minute load average per usable core) when calibrating is said to be
#: busy: its timings come out long (on 2 oversubscribed cores, two-thread steps were up to 80x slower).
BUSY_LOAD_PER_CORE = 0.5
#: A model whose training step takes longer than this (seconds, at the cell's batch) is big enough that
#: its head is a rounding error: a spec that differs from it only in the number of classes takes its
#: timings instead of being measured again (ViT-B for 10 and for 7 classes).
BORROW_ABOVE_S = 1.0
#: Timed repetitions at most per quantity (the lower median is kept) and at least.
MAX_REPEATS, MIN_REPEATS = 100, 2
#: The probe jobs' time limit (seconds: `measure_startup`, `measure_client_round`); it also bounds what
#: a file may say they measured (a start-up cannot take longer than the job that measured it).
PROBE_TIMEOUT_S = 600

# -- what a calibration file may hold (read_calibration) -----------------------------------------------
# A file outside these bounds was not written by `fedrepro calibrate` (damaged, forged or hand-edited):
# its numbers would turn every estimate into nonsense or an overflow (1e308 s a step overflowed the
# SLURM time limit, which stopped every workflow before any job), so it is refused whole.

#: Seconds per training step, head step or forwarded sample, at least: a nanosecond. A forward of
#: FORWARD_BATCH samples costs at least a kernel launch (microseconds) on any device, so nothing
#: measured falls below it (the smallest in docs/calibrations/: 3.5e-7 s a forwarded sample on the 2-core
#: CPU); a 0 would make every job free.
MIN_TIMING_S = 1e-9
#: ... and at most an hour: the slowest step measured here, ViT-B/16 at batch 2 on the loaded 2-core
#: CPU (about 7 s), scaled to batch 256 is 15 minutes; at an hour a step no cell trains at all.
MAX_TIMING_S = 3600.0
#: A job's start-up (`startup_s`), at least: a fresh interpreter that imports torch takes seconds
#: (4-6 s here); no job starts in a tenth. At most PROBE_TIMEOUT_S (the probe job's own limit).
MIN_STARTUP_S = 0.1
#: Threads a calibration (its `threads`, `calibrate --threads`) may be taken at: the hardware threads
#: of the largest node on sale (two 128-core CPUs with SMT: 512). A torch pool larger than the cores
#: only waits on itself: `calibrate --threads 100000` made no progress in 90 s.
MAX_THREADS = 512
#: Characters of a text field (`device`, `torch`, `updated`, ...): a device name is under 100
#: ("cuda: NVIDIA H100 80GB HBM3"); the estimate's line prints it, so it must stay one short line.
MAX_TEXT_CHARS = 200
#: Characters of a `models` key (a ModelSpec's canonical JSON: the shipped configs' longest is about
#: 400) and its JSON nesting (model, params, a list in them: 4 levels). The key is parsed again to
#: lend timings across classes (`borrowable`): a string of 100,000 brackets ended in a RecursionError.
MAX_KEY_CHARS, MAX_KEY_DEPTH = 4096, 16


@dataclass(frozen=True)
class ModelSpec:
    """What a training step's time depends on: the model as the cell names it, one sample's shape,
    the classes, the training batch size and the weight layout (training.channels_last)."""

    model: dict
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    channels_last: bool | str

    @property
    def key(self) -> str:
        """The spec as the cache names it (canonical JSON: one text per spec)."""
        return canonical_json({**asdict(self), "input_shape": list(self.input_shape)})

    def label(self) -> str:
        """A short human name: model, input, classes, batch."""
        return (f"{self.model['name']} {'x'.join(map(str, self.input_shape))} {self.num_classes} classes "
                f"batch {self.batch_size}")


def model_spec(cell: dict[str, Any], datasets: dict[str, dict]) -> ModelSpec:
    """The ModelSpec of a resolved cell (`datasets`: the resolved experiment's)."""
    from .data.datasets import sample_shape

    ds = datasets[cell["dataset"]]
    t = cell["training"]
    return ModelSpec(cell["model"], tuple(sample_shape(cell["dataset"], ds["params"])), int(ds["num_classes"]),
                     int(t["batch_size"]), t.get("channels_last", False))


# -- the machine --------------------------------------------------------------------------------------

def device_name(device) -> str:
    """The name calibrations are keyed by: 'cpu: <model name>' or 'cuda: <GPU name>'."""
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {cpu_name()}"


def gpu_name() -> str | None:
    """The name (as `device_name` spells it) of the GPU `--device auto` would take, from nvidia-smi
    without initialising CUDA (fast enough for `fedrepro validate`); None without one."""
    from .local_plan import query_gpu_names

    names = query_gpu_names(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return f"cuda: {names[0]}" if names else None


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


# -- the cache ----------------------------------------------------------------------------------------

def calibration_path(device: str, threads: int, torch: str, root: str | os.PathLike = CALIBRATION_DIR) -> Path:
    """The cache file of (device, threads, torch version): a file name made of them."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", device).strip("-")[:80] or "device"
    return Path(root) / f"{slug}-t{threads}-torch{re.sub(r'[^A-Za-z0-9.]+', '-', torch)}.json"


#: How to mend a file that is refused: it is a cache, measured again in seconds.
_REMEDY = "delete it and run `fedrepro calibrate CONFIG`"


def _refuse(path: Path, where: str, value: Any, allowed: str) -> ConfigError:
    """The one-line refusal of a calibration file: the file, the key, its value and what is allowed."""
    return ConfigError(f"calibration file {path}: key '{where}' has value {show(value)}; allowed: {allowed} ({_REMEDY})")


def _seconds(path: Path, where: str, value: Any, low: float, high: float) -> float:
    """`value` as seconds, refused unless a finite number from `low` to `high`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise _refuse(path, where, value, f"a number of seconds from {low:g} to {high:g}")
    return float(value)


def _text(path: Path, where: str, value: Any) -> str:
    """`value`, refused unless a printable string of at most MAX_TEXT_CHARS (the estimate prints it on one line)."""
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS or not value.isprintable():
        raise _refuse(path, where, value, f"a printable string of at most {MAX_TEXT_CHARS} characters")
    return value


def _key_name(key: str) -> str:
    """A models key as a refusal names it: its start, escaped to one line."""
    return ascii(key[:60])[1:-1] + ("..." if len(key) > 60 else "")


def _check_spec_key(path: Path, key: str) -> None:
    """A models key must be what ModelSpec.key writes: a short JSON object of a spec's fields, shallow."""
    fields = {"model", "input_shape", "num_classes", "batch_size", "channels_last"}
    try:
        spec = load_json(key, MAX_KEY_DEPTH) if len(key) <= MAX_KEY_CHARS else None
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or not fields <= spec.keys():
        raise ConfigError(f"calibration file {path}: key 'models' holds the key {show(key)}; allowed: a model spec as "
                          f"`fedrepro calibrate` writes it (a JSON object with {', '.join(sorted(fields))}; at most "
                          f"{MAX_KEY_CHARS} characters, nested at most {MAX_KEY_DEPTH} deep) ({_REMEDY})")


def _check_entry(path: Path, key: str, entry: Any) -> None:
    """One model's timings: each a number of seconds within MIN_TIMING_S .. MAX_TIMING_S."""
    _check_spec_key(path, key)
    if not isinstance(entry, dict):
        raise ConfigError(f"calibration file {path}: key 'models.{_key_name(key)}' is no mapping; allowed: the entries "
                          f"`fedrepro calibrate` writes ({_REMEDY})")
    for field in ("train_step_s", "forward_sample_s", "head_step_s"):
        _seconds(path, f"models.{_key_name(key)}.{field}", entry.get(field), MIN_TIMING_S, MAX_TIMING_S)


def _check_header(path: Path, data: dict) -> None:
    """The file's own keys: its format, device, threads, torch, dates and the per-job timings."""
    if data.get("format") != FORMAT:
        raise _refuse(path, "format", data.get("format"), repr(FORMAT))
    for key in ("device", "torch"):
        _text(path, key, data.get(key))
    threads = data.get("threads")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise _refuse(path, "threads", threads, f"an integer from 1 to {MAX_THREADS}")
    if not isinstance(data.get("models"), dict):
        raise _refuse(path, "models", data.get("models"), "a mapping of model spec -> timings")
    for key in ("updated", "fedrepro", "kernels"):  # optional: the date an estimate says, and the writer's version
        if data.get(key) is not None:
            _text(path, key, data[key])
    # optional: a file written before the client-round probe lacks it (read as 0; the probe floors it at 0)
    if data.get("startup_s") is not None:
        _seconds(path, "startup_s", data["startup_s"], MIN_STARTUP_S, PROBE_TIMEOUT_S)
    if data.get("client_round_s") is not None:
        _seconds(path, "client_round_s", data["client_round_s"], 0.0, MAX_CLIENT_ROUND_S)


def read_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """A calibration file, checked against its schema and bounds (at most MAX_FILE_BYTES, JSON nested at
    most io.MAX_JSON_DEPTH deep, every timing within its bounds above): ConfigError naming the file, the
    key, its value and what is allowed, where it is not one."""
    path = Path(path)
    try:
        data = read_json(path, MAX_FILE_BYTES)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"calibration file {path} cannot be read ({exc}); allowed: a file `fedrepro calibrate` "
                          f"wrote, at most {MAX_FILE_BYTES:,} bytes ({_REMEDY})") from None
    if not isinstance(data, dict):
        raise _refuse(path, "format", data, repr(FORMAT))
    _check_header(path, data)
    for key, entry in data["models"].items():
        _check_entry(path, key, entry)
    return data


def load_calibrations(root: str | os.PathLike = CALIBRATION_DIR) -> tuple[list[dict[str, Any]], list[str]]:
    """Every calibration cached under `root`, and one line per file that could not be used."""
    root = Path(root)
    found, problems = [], []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            found.append({**read_calibration(path), "path": str(path)})
        except ConfigError as exc:
            problems.append(str(exc))
    return found, problems


def find_calibration(calibrations: list[dict], device: str, threads: int, torch: str | None = None,
                     kernels: str | None = None) -> dict | None:
    """The calibration of (device, threads[, torch version][, CPU kernel level]) among `calibrations`,
    or None. A file without a kernel level (written before issue 56) matches any level."""
    for c in calibrations:
        if (c["device"] == device and c["threads"] == threads and (torch is None or c["torch"] == torch)
                and (kernels is None or c.get("kernels") in (None, kernels))):
            return c
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save_entry(path: Path, header: dict[str, Any], key: str | None, entry: dict[str, Any] | None) -> dict[str, Any]:
    """Add one model's entry (or, with key None, only the header: startup) to the cache file `path`,
    written atomically; the file as written. What read_calibration would refuse is refused before it is
    written (a step slower than MAX_TIMING_S), so that no run leaves a cache that stops the next one."""
    data = read_calibration(path) if path.exists() else {"format": FORMAT, "models": {}}
    data.update(header)
    data["updated"] = _now()
    _check_header(path, data)
    if key is not None:
        _check_entry(path, key, entry)
        data["models"][key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)
    return data


# -- measuring ----------------------------------------------------------------------------------------

def _timed(step: Callable[[], None], sync: Callable[[], None], budget: float) -> tuple[float, int]:
    """(lower median seconds, repetitions) of `step`, repeated until `budget` seconds or MAX_REPEATS
    (at least MIN_REPEATS times)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_REPEATS or (len(times) < MAX_REPEATS and time.perf_counter() - start < budget):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[(len(times) - 1) // 2], len(times)


def scaled_batch(batch: int, probe_batch: int, probe_s: float, budget: float) -> int:
    """The batch to time at: `batch` where its predicted step (linear in the batch from the probe)
    fits MIN_REPEATS + 1 times (a warm-up) in `budget`, else the largest power of two below it that does."""
    per_sample = probe_s / probe_batch
    fits = lambda b: per_sample * b * (MIN_REPEATS + 1) <= budget
    if fits(batch):
        return batch
    b = probe_batch
    while b * 2 < batch and fits(b * 2):
        b *= 2
    return b


def timing_model(spec: ModelSpec, device):
    """The model of `spec` on `device`, as the engine builds it, in its layout, with values that only need
    to be finite: pre-trained weights replaced by random ones (prompted_vit `weights: none`: timing reads
    no checkpoint and no model hub), and built on the meta device, then filled with N(0, 0.02) (ViT-B's
    own initialisation takes 9 s on a 2-core CPU; the values change no time). A model that cannot be
    built on the meta device is built as the engine builds it."""
    import torch

    from .engine.layout import use_layout
    from .models import build_model

    params = dict(spec.model.get("params") or {})
    if "weights" in params:
        params["weights"] = "none"
    torch.manual_seed(0)
    try:
        with torch.device("meta"):
            model = build_model(spec.model["name"], spec.input_shape, spec.num_classes, params)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
            for name, b in model.named_buffers():  # BatchNorm statistics: a variance of 1, means and counts 0
                b.fill_(1 if name.endswith("running_var") else 0)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        model = build_model(spec.model["name"], spec.input_shape, spec.num_classes, params).to(device)
    return use_layout(model, spec.channels_last, device)


def measure(spec: ModelSpec, device, budget: float | None = None) -> dict[str, Any]:
    """Seconds per training step at `spec.batch_size` (or scaled from a smaller batch), per sample of a
    forward without gradient, and per head step of HEAD_BATCH, of `spec`'s model on `device`; about
    `budget` (default BUDGET_S) seconds of timing for each."""
    import torch
    import torch.nn.functional as F

    budget = BUDGET_S if budget is None else budget
    t0 = time.perf_counter()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    model = timing_model(spec, device)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def data(batch: int):
        x = torch.randn((batch, *spec.input_shape), generator=gen).to(device)
        return x, torch.randint(0, spec.num_classes, (batch,), generator=gen).to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def train_step(x, y):
        def step():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    model.train()
    probe_batch = min(spec.batch_size, 2)
    probe = train_step(*data(probe_batch))
    probe()  # warm-up: kernels chosen, memory allocated
    sync()
    probe_s, probe_reps = _timed(probe, sync, 0.0)
    batch = scaled_batch(spec.batch_size, probe_batch, probe_s, budget)
    if batch == probe_batch:  # too slow for a larger batch: the probe is the measurement
        train_s, train_reps = probe_s, probe_reps
    else:
        step = train_step(*data(batch))
        step()
        sync()
        train_s, train_reps = _timed(step, sync, budget)

    model.eval()
    guess = probe_s / 3 / probe_batch  # a forward: about a third of a step
    forward_batch = scaled_batch(FORWARD_BATCH, probe_batch, guess * probe_batch, budget)
    x, _ = data(forward_batch)
    with torch.no_grad():
        forward = lambda: model(x)
        if guess * forward_batch < budget / 4:  # a slow model was warmed up by its training steps already
            forward()
            sync()
        forward_s, forward_reps = _timed(forward, sync, budget)

    head = model.head
    head.train()
    z = torch.randn((HEAD_BATCH, model.feature_dim), generator=gen).to(device)
    y = torch.randint(0, spec.num_classes, (HEAD_BATCH,), generator=gen).to(device)
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-3, momentum=0.9)

    def head_step():
        loss = F.cross_entropy(head(z), y)
        head_opt.zero_grad(set_to_none=True)
        loss.backward()
        head_opt.step()

    head_step()
    head_s, _ = _timed(head_step, sync, budget / 4)
    return {
        "train_step_s": train_s * spec.batch_size / batch,  # scaled linearly where timed at a smaller batch
        "train_batch": batch,
        "train_repeats": train_reps,
        "forward_sample_s": forward_s / forward_batch,
        "forward_batch": forward_batch,
        "forward_repeats": forward_reps,
        "head_step_s": head_s,
        "seconds": round(time.perf_counter() - t0, 3),
        "measured": _now(),
        "label": spec.label(),
    }


def borrowable(spec: ModelSpec, entries: dict[str, dict]) -> ModelSpec | None:
    """A measured spec (among `entries`' keys) that differs from `spec` only in the number of classes and
    whose training step takes over BORROW_ABOVE_S: its timings stand for `spec`'s (see BORROW_ABOVE_S)."""
    for key, entry in entries.items():
        try:
            other = load_json(key, MAX_KEY_DEPTH)
        except ValueError:
            continue
        if (isinstance(other, dict) and entry.get("train_step_s", 0) > BORROW_ABOVE_S and "borrowed_from" not in entry
                and {**other, "num_classes": spec.num_classes} == json.loads(spec.key)):
            return ModelSpec(other["model"], tuple(other["input_shape"]), other["num_classes"], other["batch_size"],
                             other["channels_last"])
    return None


#: The job `measure_startup` times: one round of FedAvg on 2 clients of scikit-learn's digits (bundled, no
#: download), a linear model: its training is milliseconds, the rest is what every job pays.
STARTUP_CONFIG = {
    "experiment": "startup",
    "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": []}}}},
    "partitions": {"iid": {"partitioner": "iid", "num_clients": 2, "seed": 0}},
    "methods": {"fedavg": {}},
    "training": {"rounds": 1, "batch_size": 256, "checkpoint_every": 1},
    "seeds": [0],
}


def measure_startup(device, threads: int) -> float:
    """Seconds of a whole `fedrepro train` job whose training takes none (STARTUP_CONFIG), run as the
    workflow runs one: a fresh interpreter, its imports (and CUDA's initialisation on a GPU), the checks,
    reading the shards, scoring, and writing metrics.json, provenance.json and the final model."""
    return _probe_job(STARTUP_CONFIG, device, threads, "start-up")[0]


#: The job `measure_client_round` times: CLIENT_ROUND_ROUNDS rounds of FedAvg on CLIENT_ROUND_CLIENTS clients of
#: digits (about 140 training samples each), one step of a linear model a client and round (batch 256),
#: scored once at the end.
CLIENT_ROUND_ROUNDS, CLIENT_ROUND_CLIENTS = 40, 10
#: The most `client_round_s` a file may say: the whole probe job within its limit, over its client rounds.
MAX_CLIENT_ROUND_S = PROBE_TIMEOUT_S / (CLIENT_ROUND_ROUNDS * CLIENT_ROUND_CLIENTS)
CLIENT_ROUND_CONFIG = {
    **STARTUP_CONFIG,
    "experiment": "client-round",
    "partitions": {"iid": {"partitioner": "iid", "num_clients": CLIENT_ROUND_CLIENTS, "seed": 0}},
    "training": {"rounds": CLIENT_ROUND_ROUNDS, "batch_size": 256, "eval_every": CLIENT_ROUND_ROUNDS,
                 "checkpoint_every": CLIENT_ROUND_ROUNDS},
}


def _probe_job(config: dict[str, Any], device, threads: int,
               name: str) -> tuple[float, dict[str, Any], dict[str, Any], list[int]]:
    """(wall seconds, metrics.json, the resolved experiment, the clients' training sizes) of `config`'s one cell
    run as the workflow runs a job: `fedrepro train` in a fresh interpreter on shards of scikit-learn's
    digits written to a temporary folder."""
    import json
    import tempfile

    from .config import resolve_experiment
    from .data.dataset_registry import load_dataset
    from .data.shards import write_partition

    exp = resolve_experiment(config)
    part, cell = exp["partitions"][0], exp["cells"][0]
    with tempfile.TemporaryDirectory(prefix=f"fedrepro-{name}-") as tmp:
        shards = Path(tmp) / part["id"]
        write_partition(load_dataset("digits", Path(tmp) / "raw"), part["spec"], shards)
        manifest = json.loads((shards / "manifest.json").read_text())
        command = [sys.executable, "-m", "fedrepro", "train", "--cell", json.dumps(cell), "--shards", str(shards),
                   "--out-dir", str(Path(tmp) / "out"), "--device", str(device), "--threads", str(threads)]
        t = time.perf_counter()
        try:  # its output is discarded past the bound: only the time counts
            run_bounded(command, timeout=PROBE_TIMEOUT_S, program=f"fedrepro train (the {name} probe)")
        except ProgramFailed as exc:
            raise ConfigError(f"calibrate: {exc}") from None
        wall = time.perf_counter() - t
        sizes = [int(c["sizes"]["train"]) for c in manifest["clients"] if not c.get("unseen")]
        return wall, json.loads((Path(tmp) / "out" / "metrics.json").read_text()), exp, sizes


def measure_client_round(device, threads: int) -> float:
    """Seconds the engine spends per client and round beside the client's training steps (the model's
    parameters swapped in and out, the optimizer set up, the batches drawn, the aggregation): the training
    time of CLIENT_ROUND_CONFIG's job, one step a client and round, less its steps at their calibrated
    time, over its client rounds. Tiny models over many rounds (fedcrc_cpu: an MLP on digits, 100 rounds
    of 9 clients) spend a share of their training there that a bare step's timing leaves out. (A second
    job at about 18 steps a client and round, to split a per-step share off, gave 0-0.08 ms a step on the
    2-core machine, within the bare step's own noise: not measured.)"""
    import dataclasses
    import math

    _, metrics, exp, sizes = _probe_job(CLIENT_ROUND_CONFIG, device, threads, "client-round")
    batch = CLIENT_ROUND_CONFIG["training"]["batch_size"]
    spec = model_spec(exp["cells"][0], exp["datasets"])  # the step each client takes: all its samples at once
    one_step = dataclasses.replace(spec, batch_size=min(batch, sorted(sizes)[len(sizes) // 2]))
    step = measure(one_step, device)["train_step_s"]
    steps = CLIENT_ROUND_ROUNDS * sum(math.ceil(n / batch) for n in sizes)
    client_rounds = CLIENT_ROUND_ROUNDS * len(sizes)
    return max(0.0, metrics["resources"]["train_time_s"] - steps * step) / client_rounds


def calibrate(specs: list[ModelSpec], device, threads: int, deterministic: bool = True, force: bool = False,
              root: str | os.PathLike = CALIBRATION_DIR, say: Callable[[str], None] = print) -> Path:
    """Measure every spec of `specs` not yet cached (all with `force`), and the start-up, on `device` at
    `threads`, into the cache file of this device, threads and torch; the file. `say` gets a line per
    model (and a warning when the machine is busy)."""
    import torch

    from .engine.run import set_determinism
    from .local_plan import usable_cores
    from .version import __version__

    torch.set_num_threads(threads)
    set_determinism(deterministic)  # as the cells' jobs run
    name, version = device_name(device), torch_version()
    path = calibration_path(name, threads, version, root)
    existing = read_calibration(path) if path.exists() else None
    cached = {} if existing is None or force else existing["models"]
    load, cores = os.getloadavg()[0], usable_cores()
    header = {"device": name, "threads": threads, "torch": version, "fedrepro": __version__, "load_average": round(load, 2),
              "kernels": torch.backends.cpu.get_cpu_capability()}  # the CPU kernel level (fedrepro/kernels.py)
    if load > BUSY_LOAD_PER_CORE * cores:
        say(f"[fedrepro] warning: the machine is busy (load average {load:.1f} on {cores} cores): the timings will come "
            "out long; calibrate an idle machine")
    if threads > cores:
        say(f"[fedrepro] warning: {threads} threads on {cores} usable cores wait for each other: the timings will come "
            "out long; calibrate at most at the cores' count, on the machine the cells will run on")
    if force or existing is None or existing.get("startup_s") is None:
        startup = measure_startup(device, threads)
        save_entry(path, {**header, "startup_s": round(startup, 3)}, None, None)
        say(f"[fedrepro] start-up of a job: {startup:.1f} s")
    if force or existing is None or existing.get("client_round_s") is None:
        per_client = measure_client_round(device, threads)
        save_entry(path, {**header, "client_round_s": round(per_client, 6)}, None, None)
        say(f"[fedrepro] the engine beside a client's steps: {per_client * 1e3:.2f} ms a client and round")
    say(f"[fedrepro] calibrating {len(specs)} model(s) on {name}, {threads} thread(s), torch {version}")
    for spec in specs:
        if spec.key in cached:
            say(f"  {spec.label()}: cached (--force measures again)")
            continue
        donor = borrowable(spec, cached)
        if donor is not None:
            entry = {**cached[donor.key], "borrowed_from": donor.key, "seconds": 0.0, "label": spec.label()}
            cached[spec.key] = entry
            save_entry(path, header, spec.key, entry)
            say(f"  {spec.label()}: the timings of {donor.label()} (only the classes differ; its step takes over "
                f"{BORROW_ABOVE_S:g} s)")
            continue
        entry = measure(spec, device)
        cached[spec.key] = entry
        save_entry(path, header, spec.key, entry)
        scaled = f" (timed at batch {entry['train_batch']}, scaled)" if entry["train_batch"] != spec.batch_size else ""
        say(f"  {spec.label()}: training step {entry['train_step_s'] * 1e3:,.2f} ms{scaled}, forward "
            f"{entry['forward_sample_s'] * 1e6:,.1f} us/sample, head step {entry['head_step_s'] * 1e3:,.3f} ms; "
            f"measured in {entry['seconds']:.1f} s")
    return path
