"""Throughput of the engine on one device: rounds/s and samples/s of each training path beside
centralized training at the same batch size, the GPU's busy fraction and the time split,
and (--split) where each method's round goes.

    .venv/bin/python benchmarks/gpu_throughput.py                                  # GPU if present, else CPU
    .venv/bin/python benchmarks/gpu_throughput.py --fraction 0.1 --rounds 2 --threads 1   # a short CPU run
    .venv/bin/python benchmarks/gpu_throughput.py --paths sequential vectorized compiled --clients 20 100 --batch 10 64
    .venv/bin/python benchmarks/gpu_throughput.py --split fedavg ditto fedper apfl fedproto --clients 20 --batch 10 \
        --paths nchw sequential
    .venv/bin/python benchmarks/gpu_throughput.py --paths cumulative --methods fedavg fedper --clients 20 --batch 10 \
        --eval-every 1 --rounds 1         # issue 36: each lever added in turn (benchmarks/gpu_launch.sh)

Data and protocol: Fashion-MNIST, PFLlib's Dir(0.1) partition (the partition of
benchmarks/parity_pfllib.py: `dirichlet`, self-balancing, min_partition_size 40, seed 1,
pooled, unstratified 75/25 split) into 20 and 100 clients, optionally every client cut to
`--fraction` of its data class by class; model fedavg_cnn; every client every round, one
local epoch, batch 10 and 64 with drop_last, SGD lr 0.005. `--dataset digits` runs the same
protocol on scikit-learn's digits with an MLP (a quick check of the script, no download).

Rows, all in one process on the same device and client tensors:
* engine/<path>: the engine's round loop (`Engine.run`, evaluation only after the last
  round), rounds/s and samples/s of its training time. Paths: `sequential` (the default:
  one client after another, eager), `vectorized` (`training.vectorize: true`: the sampled
  clients' steps as one vmap computation), `compiled` (`training.compile: true`:
  torch.compile of the step, CUDA graphs on a GPU), `channels_last`
  (`training.channels_last: true`: NHWC convolution weights), `nchw` (`training.channels_last:
  false`: the default layout, which was the CPU default before "auto"; every other path uses
  the default "auto" = NHWC on the CPU, the default layout on a GPU). A path with levers added,
  `vectorized+resident_batches+fused_step`, sets `training.levers` (issue 36, docs/throughput.md);
  `--paths cumulative` is sequential, vectorized, then vectorized with resident_batches,
  fused_step, cuda_graph, device_losses and batched_eval added one at a time. A warm-up round
  (it compiles and captures where it does; `warmup_s`) is run first and not timed, for every path.
  `--methods` (default fedavg) runs each path for each method, at its hparams of PFLlib's protocol.
  Each row records its `levers`, `s_per_round` (training and evaluation per timed round: PFLlib's
  per-round Budget with `--eval-every 1`) and the final test accuracies `global_acc` and
  `personal_acc` (weighted means), which compare across the paths of a method.
  peak_round_mb / before_round_mb: on CUDA, the peak memory allocated during the warm-up round
  and what was allocated before it (client data, model, server state); NaN on the CPU.
* centralized: a plain loop over the pooled train data of all clients, same model, batch
  size and optimizer: the throughput the hardware gives this model at this batch size.
* ratio = engine samples/s / centralized samples/s (goal on a GPU at batch 10: >= 3 for
  the vectorized path).
* busy: the GPU's utilization sampled through NVML (`torch.cuda.utilization()`, needs the
  `nvidia-ml-py` package; otherwise the fraction of wall time the profiler sees kernels
  running); on the CPU "n/a".
* split of one profiled round (torch.profiler): kernels (CUDA: summed kernel time; CPU:
  self time of aten operators), syncs (host waits: cudaDeviceSynchronize,
  cudaStreamSynchronize, blocking cudaMemcpy; 0 on the CPU) and host (the rest of the wall
  time: Python, dispatch, launches).

--split M ...: per method (and per --paths, default sequential: interleaved, so the paths of
a method see the same machine load), one row of seconds per round split into training steps
(training.fit/fit_many), extra passes (`features`, `fit_head`, `forward_with`), parameter
copies (`get_params`/`set_params`), evaluation predictions (evaluation.predict, probs),
personalization inside the evaluation (fits and copies there) and the rest (method logic,
metrics, Python). Timing is wall-clock on a possibly shared machine: compare ratios within
one run.

PFLlib on the same GPU, for the ">= 10x PFLlib's rounds/s" goal (data exported by
benchmarks/parity_pfllib.py into <work>/pfllib/dataset/FashionMNIST_fedrepro_<partition id>):

    cd <work>/pfllib/system && python -u main.py -data FashionMNIST_fedrepro_<id> -m CNN -algo FedAvg \\
        -gr 20 -nc 20 -jr 1 -lbs 10 -ls 1 -lr 0.005 -eg 1 -ncl 10 -dev cuda
    # its "Average time cost per round" against this script's 1 / (engine rounds/s) + eval s/round
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_pfllib import FEDREPRO_TRAINING, ROWS, partition_config  # noqa: E402  (the same partition and protocol)

from fedrepro.config import VECTORIZED_LEVERS, resolve_experiment  # noqa: E402
from fedrepro.data.datasets import load_dataset, prepare_dataset  # noqa: E402
from fedrepro.data.shards import load_partition, write_partition  # noqa: E402
from fedrepro.engine import beyond, embedding, evaluation, loop, training  # noqa: E402
from fedrepro.engine.data import load_clients  # noqa: E402
from fedrepro.engine.engine import Engine, use_layout  # noqa: E402
from fedrepro.engine.run import pick_device, set_determinism  # noqa: E402
from fedrepro.io import derive_seed, write_json_atomic  # noqa: E402
from fedrepro.models import build_model  # noqa: E402
from fedrepro.registry import ConfigError  # noqa: E402

PATHS = {"sequential": {}, "vectorized": {"vectorize": True}, "compiled": {"compile": True},
         "channels_last": {"channels_last": True}, "nchw": {"channels_last": False}}
#: issue 36's levers (`training.levers`) in the order `--paths cumulative` adds them, each on top of
#: the ones before (cuda_graph needs resident_batches and fused_step).
LEVER_ORDER = (*VECTORIZED_LEVERS, "batched_eval")
#: The model of each dataset the benchmark runs: PFLlib's CNN on Fashion-MNIST; on digits (8x8
#: images, bundled with scikit-learn: the quick CPU mode of benchmarks/gpu_check.sh) an MLP.
MODELS = {"fmnist": {"name": "fedavg_cnn"}, "digits": {"name": "mlp", "params": {"hidden": [64]}}}
SYNC_EVENTS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def path_training(path: str, method: str) -> dict:
    """The training keys of an engine path for `method`: a name of PATHS, optionally with levers added
    (`vectorized+resident_batches+fused_step`: `training.levers` on top of that path), but those that
    cannot act on `method` (config.LEVER_TARGETS: batched_eval on a method without personalized models),
    which the config would refuse."""
    from fedrepro.config import LEVER_TARGETS
    from fedrepro.methods import METHODS

    base, *levers = path.split("+")
    if base not in PATHS:
        raise ValueError(f"path {path!r}: {base!r} is not one of {list(PATHS)}")
    levers = [lever for lever in levers if lever not in LEVER_TARGETS or LEVER_TARGETS[lever][1](METHODS.get(method))]
    return {**PATHS[base], **({"levers": levers} if levers else {})}


def cumulative_paths() -> list[str]:
    """`--paths cumulative`: sequential, vectorized, then vectorized with each lever of LEVER_ORDER
    added to the ones before it."""
    return ["sequential", "vectorized"] + ["+".join(["vectorized", *LEVER_ORDER[:i + 1]]) for i in range(len(LEVER_ORDER))]


def parity_run(method: str) -> tuple[dict, dict]:
    """(hparams, training) of `method` at PFLlib's protocol: its first row in parity_pfllib.ROWS
    (Ditto's lam and personal epochs as PFLlib's mu and plocal_epochs), else the defaults."""
    run = next((r.fedrepro for r in ROWS if r.fedrepro.method == method), None)
    return (dict(run.hparams), dict(run.training)) if run else ({}, {})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def experiment(clients: int, fraction: float, batch: int, rounds: int, method: str = "fedavg", hparams: dict | None = None,
               dataset: str = "fmnist", **training) -> dict:
    return resolve_experiment({
        "experiment": "throughput", "datasets": {dataset: {"model": MODELS[dataset]}},
        "partitions": {"pfllib_dir0.1": partition_config(clients, fraction)},
        "methods": {method: {"method": method, "hparams": hparams or {}}}, "seeds": [0],
        "training": {**FEDREPRO_TRAINING, "rounds": rounds, "batch_size": batch, "eval_every": 10**6, **training},
    })


def partition(args, clients: int) -> tuple[dict, list]:
    part = experiment(clients, args.fraction, 10, 1, dataset=args.dataset)["partitions"][0]
    out = args.work / "shards" / part["id"]
    if not (out / "manifest.json").exists():
        root = Path(args.raw_root or args.work / "raw" / args.dataset)
        prepare_dataset(args.dataset, root)
        write_partition(load_dataset(args.dataset, root), part["spec"], out)
    return load_partition(out)


class Busy:
    """The GPU's utilization sampled every 20 ms through NVML while the block runs."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self._stop = device, [], threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            try:
                torch.cuda.utilization(self.device)
            except Exception:  # no NVML (nvidia-ml-py) here: the profiler's estimate is used
                return self
            def loop():
                while not self._stop.wait(0.02):
                    self.samples.append(torch.cuda.utilization(self.device))
            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False

    @property
    def fraction(self) -> float:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else math.nan


def profile_split(fn, device: torch.device) -> dict[str, float]:
    """Seconds of kernels, host syncs and the rest of the host's time while `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    syncs = sum(e.cpu_time_total for e in events if e.name.startswith(SYNC_EVENTS)) / 1e6
    if device.type == "cuda":
        kernels = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))) / 1e6
        host = max(wall - syncs, 0.0)
    else:
        kernels = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")) / 1e6
        host = max(wall - kernels - syncs, 0.0)
    return {"wall_s": wall, "kernels_s": kernels, "syncs_s": syncs, "host_s": host}


def engine_cell(args, clients: int, batch: int, path: str, method: str) -> dict:
    hparams, training = parity_run(method)
    every = {"eval_every": args.eval_every} if args.eval_every else {}
    return experiment(clients, args.fraction, batch, args.rounds, method=method, hparams=hparams, dataset=args.dataset,
                      **training, **every, **path_training(path, method))["cells"][0]


def engine_row(args, manifest, shards, device, clients: int, batch: int, path: str, method: str = "fedavg") -> dict:
    cell = engine_cell(args, clients, batch, path, method)
    data = load_clients(manifest, shards, device)
    n_train = sum(c.num_train - (c.num_train % batch if c.num_train >= batch else 0) for c in data)  # drop_last
    engine = Engine(cell, manifest, data, device, progress=False)
    engine.method.setup()
    engine.round = 1
    initial = engine.get_params()
    warm = lambda: engine.method.aggregate(loop.train_round(engine, 1)[0])
    t0 = time.perf_counter()
    memory = round_memory(warm, device)  # the warm-up round (compilation, capture, allocator): not timed
    warmup_s = time.perf_counter() - t0
    # The timed run reuses the warmed-up engine (its compiled model object, allocator). run()
    # restarts the server from the model's parameters, which the sequential path leaves at its last
    # client's: they go back to the seeded initialisation, so every path starts its timed rounds
    # from the same state (client state, FedPer's heads or Ditto's personal models, carries over
    # from the warm-up round alike) and the paths' final accuracies compare.
    engine.set_params(initial)
    with Busy(device) as busy:
        metrics = engine.run()
    sync(device)
    # one more round, profiled, after the timed run: the run's accuracies stay those of its own rounds
    split = profile_split(warm, device) if profiled(args, path) else NO_SPLIT
    res, summary = metrics["resources"], metrics.get("summary") or {}
    train_s = res["train_time_s"]
    busy_frac = busy.fraction if not math.isnan(busy.fraction) else (
        split["kernels_s"] / split["wall_s"] if device.type == "cuda" else math.nan)
    return {"row": f"engine/{path}", "method": method, "levers": list(cell["training"].get("levers") or []),
            "clients": clients, "batch": batch, "rounds_per_s": args.rounds / train_s,
            "samples_per_s": n_train * args.rounds / train_s, "eval_s": res["eval_time_s"],
            # a round with its evaluation (PFLlib's Budget): evaluation every round with --eval-every 1
            "s_per_round": (train_s + res["eval_time_s"]) / args.rounds, "warmup_s": warmup_s, "busy": busy_frac,
            "vectorized": engine.vectorized, **memory, **split,
            **{f"{kind}_acc": (summary.get(f"{kind}_acc") or {}).get("weighted_mean") for kind in ("global", "personal")}}


#: The split of a row that is not profiled (--profile names other rows).
NO_SPLIT = {"wall_s": math.nan, "kernels_s": math.nan, "syncs_s": math.nan, "host_s": math.nan}


def profiled(args, row: str) -> bool:
    return args.profile is None or row in args.profile


def round_memory(run_round, device: torch.device) -> dict[str, float]:
    """GPU memory of one round (`run_round()`): allocated before it (the clients' data, the model,
    the server state) and the peak while it ran (NaN on the CPU)."""
    if device.type != "cuda":
        run_round()
        return {"before_round_mb": math.nan, "peak_round_mb": math.nan}
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_round()
    sync(device)
    return {"before_round_mb": before / 2**20, "peak_round_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def central_row(args, manifest, shards, device, clients: int, batch: int) -> dict:
    data = load_clients(manifest, shards, device)
    x = torch.cat([c.train.x for c in data])
    y = torch.cat([c.train.y for c in data])
    torch.manual_seed(0)
    spec = MODELS[args.dataset]
    model = use_layout(build_model(spec["name"], manifest["sample_shape"], manifest["num_classes"], spec.get("params")).to(device),
                       "auto", device)  # the engine's default layout on this device
    opt = torch.optim.SGD(model.parameters(), lr=FEDREPRO_TRAINING["optimizer"]["lr"])
    g = torch.Generator().manual_seed(derive_seed(0, "central"))
    stop = len(y) - len(y) % batch

    def epoch():
        model.train()
        perm = torch.randperm(len(y), generator=g).to(device)
        for s in range(0, stop, batch):
            idx = perm[s : s + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    epoch()
    split = profile_split(epoch, device) if profiled(args, "centralized") else NO_SPLIT
    sync(device)
    t0 = time.perf_counter()
    with Busy(device) as busy:
        for _ in range(args.rounds):
            epoch()
        sync(device)
    wall = time.perf_counter() - t0
    busy_frac = busy.fraction if not math.isnan(busy.fraction) else (
        split["kernels_s"] / split["wall_s"] if device.type == "cuda" else math.nan)
    return {"row": "centralized", "clients": clients, "batch": batch, "rounds_per_s": args.rounds / wall,
            "samples_per_s": stop * args.rounds / wall, "eval_s": math.nan, "busy": busy_frac, **split}


# -- per-method split ------------------------------------------------------------------------

BUCKETS = {(training, "fit"): "train steps", (training, "fit_many"): "train steps", (training, "features"): "extra passes",
           (training, "fit_head"): "extra passes", (training, "forward_with"): "extra passes",
           (training, "get_params"): "copies", (training, "set_params"): "copies",
           (evaluation, "predict"): "eval predictions", (evaluation, "probs"): "eval predictions"}
EVAL_ENTRY = ((evaluation, "evaluate"), (beyond, "evaluate_beyond"))
#: The engine's rooms: where the tools above are defined and where other rooms imported them by name.
ROOMS = (training, evaluation, beyond, embedding, loop)


def _replace(old, new) -> None:
    """`old` replaced by `new` wherever a room holds it (its own module and the rooms that imported it)."""
    for room in ROOMS:
        for name, value in list(vars(room).items()):
            if value is old:
                setattr(room, name, new)


@contextmanager
def instrument(device: torch.device):
    """Exclusive wall time per bucket of the engine's tools (a nested tool's time goes to the
    nested tool); inside the evaluation, training and copies count as 'eval personalization'."""
    times: dict[str, float] = defaultdict(float)
    stack: list[list] = []  # [bucket, start, child time]
    in_eval = [0]
    originals = {key: getattr(*key) for key in list(BUCKETS) + list(EVAL_ENTRY)}

    def wrap(name, fn):
        def timed(*a, **kw):
            is_eval = name in EVAL_ENTRY
            bucket = "eval other" if is_eval else BUCKETS[name]
            if in_eval[0] and bucket in ("train steps", "extra passes", "copies"):
                bucket = "eval personalization"
            in_eval[0] += is_eval
            sync(device)
            frame = [bucket, time.perf_counter(), 0.0]
            stack.append(frame)
            try:
                out = fn(*a, **kw)
                if hasattr(out, "__next__"):  # a generator: time its consumption where it is consumed
                    out = list(out)
                return out
            finally:
                sync(device)
                stack.pop()
                in_eval[0] -= is_eval
                spent = time.perf_counter() - frame[1]
                times[bucket] += spent - frame[2]
                if stack:
                    stack[-1][2] += spent
        return timed

    wrapped = {key: wrap(key, fn) for key, fn in originals.items()}
    for key, fn in originals.items():
        _replace(fn, wrapped[key])
    try:
        yield times
    finally:
        for key, fn in originals.items():
            _replace(wrapped[key], fn)


def split_row(args, manifest, shards, device, clients: int, batch: int, method: str, path: str) -> dict:
    cell = experiment(clients, args.fraction, batch, args.rounds, method=method, eval_every=1, dataset=args.dataset,
                      **path_training(path, method))["cells"][0]
    engine = Engine(cell, manifest, load_clients(manifest, shards, device), device, progress=False)
    with instrument(device) as times:
        t0 = time.perf_counter()
        res = engine.run()["resources"]
        wall = time.perf_counter() - t0
    per_round = {k: v / args.rounds for k, v in times.items()}
    per_round["other"] = max(wall / args.rounds - sum(per_round.values()), 0.0)
    return {"row": f"split/{method}/{path}", "clients": clients, "batch": batch, "s_per_round": wall / args.rounds,
            "train_s_per_round": res["train_time_s"] / args.rounds, "eval_s_per_round": res["eval_time_s"] / args.rounds,
            **{f"{k} s": v for k, v in sorted(per_round.items())}}


def table(rows: list[dict], keys: list[str]) -> str:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")
        return str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--batch", type=int, nargs="+", default=[10, 64])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per row (after one warm-up round)")
    ap.add_argument("--fraction", type=float, default=1.0, help="every client keeps this fraction of its data")
    ap.add_argument("--paths", nargs="+", default=None, metavar="PATH",
                    help=f"engine paths: {', '.join(PATHS)}, each optionally with levers added ('vectorized+resident_batches"
                         "+fused_step'), or 'cumulative' (sequential, vectorized, then each lever of "
                         f"{', '.join(LEVER_ORDER)} added to the ones before); default: sequential and vectorized, compiled on CUDA too")
    ap.add_argument("--methods", nargs="+", default=["fedavg"], metavar="METHOD",
                    help="methods of the engine rows (default fedavg), with their hparams at PFLlib's protocol "
                         "(benchmarks/parity_pfllib.py's rows)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="evaluate every N rounds in the timed rounds (1: PFLlib's protocol; default: after the last round only)")
    ap.add_argument("--profile", nargs="+", default=None, metavar="ROW",
                    help="the rows profiled for the time split, engine paths or 'centralized' (each costs one more "
                         "round or epoch); default: every row")
    ap.add_argument("--no-central", action="store_true", help="no centralized row (no ratio_to_central)")
    ap.add_argument("--split", nargs="+", default=None, metavar="METHOD", help="per-method time split instead")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedrepro-throughput"))
    ap.add_argument("--dataset", default="fmnist", choices=list(MODELS),
                    help="fmnist (the benchmark) or digits (scikit-learn's: a quick check of the script)")
    ap.add_argument("--raw-root", default=None, help="the dataset's raw folder (default <work>/raw/<dataset>)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_determinism(True)
    device = pick_device(args.device)
    paths = [p for given in args.paths or (["sequential", "vectorized"] + (["compiled"] if device.type == "cuda" else []))
             for p in (cumulative_paths() if given == "cumulative" else [given])]
    for method in args.methods:  # a bad path or lever stops here, before any row runs
        for path in paths:
            try:
                engine_cell(args, args.clients[0], args.batch[0], path, method)
            except (ValueError, ConfigError) as exc:
                ap.error(f"--paths {path} --methods {method}: {exc}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"fraction {args.fraction}, {args.rounds} rounds per row", file=sys.stderr)
    rows = []

    def save(partial: list[dict]) -> None:  # after every row: a run stopped at a time limit keeps its rows
        if args.json:
            write_json_atomic(args.json, {"device": name, "args": {k: str(v) for k, v in vars(args).items()}, "rows": partial})

    for clients in args.clients:
        manifest, shards = partition(args, clients)
        for batch in args.batch:
            if args.split:
                for method in args.split:
                    for path in args.paths or ["sequential"]:  # interleaved: the paths of a method see the same load
                        rows.append(split_row(args, manifest, shards, device, clients, batch, method, path))
                    print(f"[throughput] {rows[-1]['row']} clients {clients} batch {batch} done", file=sys.stderr)
                continue
            central = [] if args.no_central else [central_row(args, manifest, shards, device, clients, batch)]
            for method in args.methods:
                for path in paths:
                    row = engine_row(args, manifest, shards, device, clients, batch, path, method)
                    if central:
                        row["ratio_to_central"] = row["samples_per_s"] / central[0]["samples_per_s"]
                    rows.append(row)
                    save(rows + central)
                    print(f"[throughput] {method} {row['row']} clients {clients} batch {batch}: {row['s_per_round']:.3g} "
                          f"s/round, {row['rounds_per_s']:.3g} rounds/s of training", file=sys.stderr)
            rows += central
    if args.split:
        keys = ["row", "clients", "batch", "s_per_round", "train_s_per_round", "eval_s_per_round"]
        keys += sorted({k for r in rows for k in r if k.endswith(" s")})
    else:
        keys = ["row", "method", "clients", "batch", "rounds_per_s", "s_per_round", "samples_per_s", "ratio_to_central",
                "busy", "eval_s", "warmup_s", "global_acc", "personal_acc", "peak_round_mb", "before_round_mb", "wall_s",
                "kernels_s", "syncs_s", "host_s"]
    print(f"device: {name}; split columns: one profiled round (wall = kernels + syncs + host on the CPU; on a GPU "
          "kernels run beside the host)")
    print(table(rows, keys))
    save(rows)


if __name__ == "__main__":
    main()
