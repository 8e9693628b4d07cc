"""Parity of fedrepro's baselines with PFLlib (TsingZ0/PFLlib), run unchanged, on the same
client data and protocol.

    .venv/bin/python benchmarks/parity_pfllib.py --pfllib /work/pfllib --pfllib-python /work/pfllib-venv/bin/python
    .venv/bin/python benchmarks/parity_pfllib.py --pfllib ... --methods FedAvg Ditto --seeds 0 --rounds 2
    .venv/bin/python benchmarks/parity_pfllib.py --pfllib ... --only pfllib           # one side only
    .venv/bin/python benchmarks/parity_pfllib.py --pfllib ... --rerun fedrepro       # recompute one side
    .venv/bin/python benchmarks/parity_pfllib.py --pfllib ... --fraction 1           # full scale (slow)

Protocol (PFLlib's defaults, applied to both): Fashion-MNIST, PFLlib's Dir(0.1) partition
into 20 clients (fedrepro's `dirichlet` with `self_balancing`, `min_partition_size: 40`,
seed 1, pooled official splits, unstratified 75/25 split per client), optionally every
client cut to `--fraction` of its data class by class (fedrepro's `scarcity`), FedAvgCNN,
all clients every round, batch 10 with PFLlib's drop_last, one local epoch, SGD lr 0.005,
evaluation every round, test-size-weighted accuracy (PFLlib's "Averaged Test Accuracy").

Identical data by construction: fedrepro's partition is exported to PFLlib's on-disk format
(`dataset/<NAME>/{train,test}/<i>.npz` holding data={'x','y'}), x already normalised exactly
as fedrepro's engine normalises it (`fedrepro.engine.data.to_split`), inside the work dir
next to a copy of PFLlib's unchanged `system/` folder; the user's checkout is only read.

Seeds: fedrepro's cell seed is the repeat index. PFLlib has no seed flag: `main.py` calls
`torch.manual_seed(0)` once and the `-t N` trials continue that one stream (numpy and
`random`, used for client order, are never seeded), so PFLlib's "seed s" is trial s of one
`-t` run; the trials 0..s always run together and each is cached on its own.

Timing: wall seconds per round including that round's evaluation, each framework timed by
its own clock: PFLlib's printed per-iteration `Budget` (send, evaluate, train, aggregate),
mean over iterations 1..R as PFLlib's own "Average time cost per round"; fedrepro's engine
(train_time_s + eval_time_s) / R. Both run on the CPU with one thread. A personalization that
PFLlib runs once after its loop, outside its Budget (FedBABU's fine-tuning), is left out of
both: fedrepro scores it at the last round only (`personal_eval_every` >= R) and its time
(`personal_eval_time_s`) is kept apart in the record as `after_loop_s`.

Speed on a shared machine moves by about ±0.1 in the ratio between runs minutes apart:
`--pairs N` times every run N times (PFLlib's runs, then fedrepro's, both recomputed from the
second pair on) and reports the mean of the pairs' ratios with their range. With one method
per invocation each pair runs back to back.

Results are cached per (framework, method, seed, config hash) under --work; a rerun only
computes what is missing. Outputs in --work: parity_f<fraction>_r<rounds>.md (the table), .json (rows,
every run with its per-round accuracies and times) and .csv (one line per framework, run, seed,
round and evaluated model); they cover the rows of the invocation (--methods).
See docs/parity.md for the method mapping and what PFLlib evaluates per method.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_inputs import read_json  # noqa: E402  (bounded, never blocking: a FIFO or device in --work is one line, exit 2)

# --------------------------------------------------------------------------------------------
# The method mapping. One row per compared number. `pfllib`: the PFLlib algorithm (-algo) and
# the main.py arguments that differ from PFLlib's defaults; `fedrepro`: the registered method,
# its hparams (the same value as the PFLlib argument on the same line) and training overrides.
# `column`: the fedrepro column compared (test/global or test/personal weighted mean);
# `series`: the evaluation PFLlib prints before "Averaged Test Accuracy" (its header line);
# `at`: "round" = the evaluation at the start of iteration R (= after R rounds), "final" =
# the evaluation PFLlib runs once after its loop (FedBABU's fine-tuned models).
# Values: PFLlib's main.py defaults where fedrepro's differ, except where PFLlib's default
# disables the method (mu = 0, beta = 0) or breaks it (FedAMP's 1.0s), noted per line.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class P:  # a PFLlib run: -algo and extra main.py flags
    algo: str
    args: tuple = ()


@dataclass(frozen=True)
class F:  # a fedrepro run: method, hparams, training overrides
    method: str
    hparams: tuple = ()
    training: tuple = ()


@dataclass(frozen=True)
class Row:
    name: str
    pfllib: P
    fedrepro: F
    column: str  # "global" | "personal"
    series: str  # PFLlib evaluation header
    at: str = "round"


def p(algo: str, **args) -> P:
    return P(algo, tuple(sorted(args.items())))


def f(method: str, training: dict | None = None, **hparams) -> F:
    return F(method, tuple(sorted(hparams.items())), tuple(sorted((training or {}).items())))


# The personalized column scored at the last round only (any value >= rounds): PFLlib's protocol for a method it
# personalizes once after training. Its time is not per-round work in PFLlib's Budget, so fedrepro's s/round leaves
# it out too and the record keeps it apart (`after_loop_s`).
AFTER_TRAINING = {"personal_eval_every": 10**6}

ROWS: list[Row] = [
    # Local: no hyper-parameters.
    Row("Local", p("Local"), f("local"), "personal", "Evaluate personalized models"),
    # FedAvg: no hyper-parameters.
    Row("FedAvg", p("FedAvg"), f("fedavg"), "global", "Evaluate global model"),
    # FedProx: -mu (PFLlib default 0 = FedAvg; fedrepro's 0.1).
    Row("FedProx", p("FedProx", mu=0.1), f("fedprox", mu=0.1), "global", "Evaluate global model"),
    # SCAFFOLD: -slr server_learning_rate (1.0 both).
    Row("SCAFFOLD", p("SCAFFOLD", server_learning_rate=1.0), f("scaffold", server_lr=1.0), "global", "Evaluate global model"),
    # MOON: -mu (PFLlib default 0 disables it; fedrepro's 1.0), -tau (PFLlib default 1.0).
    Row("MOON", p("MOON", mu=1.0, tau=1.0), f("moon", mu=1.0, tau=1.0), "global", "Evaluate global model"),
    # FedPer: head = the last fc in both (BaseHeadSplit / SplitModel); no hyper-parameters.
    Row("FedPer", p("FedPer"), f("fedper"), "personal", "Evaluate personalized models"),
    # FedRep: -pls plocal_epochs = head_epochs (PFLlib default 1; fedrepro's 10), body = -ls 1.
    Row("FedRep", p("FedRep", plocal_epochs=1), f("fedrep", head_epochs=1), "personal", "Evaluate personalized models"),
    # FedBABU: -fte fine_tuning_epochs 10 (both); per round PFLlib scores the un-fine-tuned model and fine-tunes
    # once, after its loop: fedrepro likewise scores the fine-tuned models at the last round only.
    Row("FedBABU", p("FedBABU", fine_tuning_epochs=10), f("fedbabu", AFTER_TRAINING, finetune_epochs=10), "global",
        "Evaluate global model"),
    Row("FedBABU (fine-tuned)", p("FedBABU", fine_tuning_epochs=10), f("fedbabu", AFTER_TRAINING, finetune_epochs=10),
        "personal", "Evaluate fine-tuned personalized models", at="final"),
    # LG-FedAvg: global part = the head (PFLlib clientlg/serverlg); no hyper-parameters.
    Row("LG-FedAvg", p("LG-FedAvg"), f("lg_fedavg"), "personal", "Evaluate global model"),
    # Ditto: -mu = lam (PFLlib default 0 disables the pull; fedrepro's 1.0), -pls plocal_epochs = personal_epochs 1.
    Row("Ditto", p("Ditto", mu=1.0, plocal_epochs=1), f("ditto", lam=1.0, personal_epochs=1), "personal",
        "Evaluate personalized models"),
    Row("Ditto (global)", p("Ditto", mu=1.0, plocal_epochs=1), f("ditto", lam=1.0, personal_epochs=1), "global",
        "Evaluate global models"),
    # pFedMe: -lam lamda 1.0 (PFLlib; fedrepro's 15), -K 5, -lrp p_learning_rate 0.01, -bt beta (PFLlib default 0
    # freezes the global model; 1.0), pFedMeOptimizer's hard-coded mu=0.001, n_i-weighted average (serverbase).
    Row("pFedMe", p("pFedMe", lamda=1.0, K=5, p_learning_rate=0.01, beta=1.0),
        f("pfedme", lam=1.0, K=5, personal_lr=0.01, beta=1.0, mu=0.001, weighting="samples"), "personal",
        "Evaluate personalized model"),
    Row("pFedMe (vs global)", p("pFedMe", lamda=1.0, K=5, p_learning_rate=0.01, beta=1.0),
        f("pfedme", lam=1.0, K=5, personal_lr=0.01, beta=1.0, mu=0.001, weighting="samples"), "global",
        "Evaluate personalized model"),
    # Per-FedAvg: alpha = beta = -lr 0.005 (clientperavg.py: beta = lr, PerAvgOptimizer lr), first-order; PFLlib's
    # server calls client.train() twice per round (serverperavg.py), so fedrepro runs 2 local epochs.
    Row("Per-FedAvg", p("PerAvg"), f("perfedavg", {"local_epochs": 2}, alpha=0.005, beta=0.005, variant="fo"),
        "personal", "Evaluate global model with one step update"),
    # APFL: -al alpha initial mixing weight 1.0 (PFLlib; fedrepro's 0.5), adaptive, 0.02 * alpha regulariser.
    Row("APFL", p("APFL", alpha=1.0), f("apfl", alpha=1.0, adaptive_alpha=True, alpha_reg=0.02), "personal",
        "Evaluate personalized models"),
    # FedAMP: -alk alphaK 5e-3, -lam lamda 5e-7, -sg sigma 0.1 (fedrepro's defaults; PFLlib's 1.0s make
    # xi_ii < 0). PFLlib's client penalty has no gradient (local training), fedrepro's code_compat reproduces it.
    Row("FedAMP", p("FedAMP", alphaK=5e-3, lamda=5e-7, sigma=0.1), f("fedamp", alphaK=5e-3, lamda=5e-7, sigma=0.1),
        "personal", "Evaluate personalized models"),
    Row("FedAMP (code_compat)", p("FedAMP", alphaK=5e-3, lamda=5e-7, sigma=0.1),
        f("fedamp", alphaK=5e-3, lamda=5e-7, sigma=0.1, code_compat=True), "personal", "Evaluate personalized models"),
    # FedALA: -et eta 1.0, -s rand_percent 80, -p layer_idx 2; ALA.py's threshold 0.1 / num_pre_loss 10 (not flags)
    # and its unbounded start phase (fedrepro's cap raised from 50 to 1000).
    Row("FedALA", p("FedALA", eta=1.0, rand_percent=80, layer_idx=2),
        f("fedala", eta=1.0, rand_percent=80, layer_idx=2, threshold=0.1, num_pre_loss=10, max_start_epochs=1000),
        "personal",
        "Evaluate global model"),
    # FedProto: -lam lamda 1.0; prototypes averaged unweighted over clients (serverproto.proto_aggregation).
    Row("FedProto", p("FedProto", lamda=1.0), f("fedproto", lam=1.0, proto_weighting="clients"), "personal",
        "Evaluate personalized models"),
    # FedPAC: -lam lamda 1.0; head phase 1 epoch at -lr (PFLlib; fedrepro's head_lr 0.1), unweighted prototypes.
    Row("FedPAC", p("FedPAC", lamda=1.0), f("fedpac", lam=1.0, head_epochs=1, head_lr=None, proto_weighting="clients"),
        "personal", "Evaluate personalized models"),
    # FedGH: -slr server_learning_rate 1.0, one pass, server batch -lbs 10; PFLlib scores client extractor + global head.
    Row("FedGH", p("FedGH", server_learning_rate=1.0),
        f("fedgh", server_lr=1.0, server_epochs=1, server_batch_size=None, personal_head="global"), "personal",
        "Evaluate personalized models"),
]

# PFLlib's main.py flags of the shared protocol (its defaults, stated explicitly).
PFLLIB_FLAGS = {"model": "CNN", "num_classes": 10, "num_clients": 20, "batch_size": 10, "local_learning_rate": 0.005,
                "local_epochs": 1, "join_ratio": 1.0, "eval_gap": 1, "device": "cpu"}

# fedrepro's matching training block (drop_last: PFLlib's DataLoader(drop_last=True)).
FEDREPRO_TRAINING = {"participation": 1.0, "batch_size": 10, "local_epochs": 1, "drop_last": True,
                     "optimizer": {"name": "sgd", "lr": 0.005}, "eval_every": 1, "checkpoint_every": 10**6}


def partition_config(num_clients: int, fraction: float) -> dict:
    """fedrepro's partition reproducing PFLlib's generate_FashionMNIST.py noniid - dir (README)."""
    part = {"partitioner": "dirichlet", "num_clients": num_clients, "seed": 1, "pool": True,
            "params": {"alpha": 0.1, "min_partition_size": 40, "self_balancing": True},
            "split": {"test_fraction": 0.25, "stratify": False}}
    if fraction < 1:
        part["scarcity"] = {"clients": "all", "fraction": fraction}
    return part


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def key_of(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1; 0 for one value) over seeds."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if len(v) == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def hp_text(row: Row) -> str:
    pf = " ".join(f"{k}={v}" for k, v in row.pfllib.args) or "-"
    fr = " ".join(f"{k}={v}" for k, v in row.fedrepro.hparams + row.fedrepro.training) or "-"
    return f"P: {pf} / F: {fr}"


# --------------------------------------------------------------------------------------------
# Data: fedrepro's partition, exported to PFLlib's format
# --------------------------------------------------------------------------------------------


def client_tensors(manifest: dict, shards: list) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Every client's train/test (x, y) exactly as fedrepro's engine feeds them: `to_split`
    with the manifest's mean/std on the CPU; x float32 (N, C, H, W), y int64."""
    import torch

    from fedrepro.engine.data import to_split

    mean = torch.tensor(manifest["mean"], dtype=torch.float32)
    std = torch.tensor(manifest["std"], dtype=torch.float32)
    out = {}
    for s in shards:
        out[s.id] = {}
        for split in ("train", "test"):
            t = to_split(s.x[split], s.y[split], mean, std, torch.device("cpu"))
            out[s.id][split] = (t.x.numpy(), t.y.numpy())
    return out


def export_pfllib(manifest: dict, shards: list, dataset_dir: Path) -> dict:
    """Write fedrepro's clients in PFLlib's format (dataset/utils/dataset_utils.py save_file):
    train/<i>.npz and test/<i>.npz, each np.savez_compressed(f, data={'x': x, 'y': y}), and
    config.json. PFLlib reads clients 0..num_clients-1 by file name, so ids must be 0..N-1."""
    ids = sorted(s.id for s in shards)
    if ids != list(range(len(ids))):
        raise ValueError(f"PFLlib needs client ids 0..N-1; the partition has {ids}")
    tensors = client_tensors(manifest, shards)
    tmp = dataset_dir.with_name(dataset_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for split in ("train", "test"):
        (tmp / split).mkdir(parents=True)
    stats = []
    for cid in ids:
        for split in ("train", "test"):
            x, y = tensors[cid][split]
            with open(tmp / split / f"{cid}.npz", "wb") as fh:
                np.savez_compressed(fh, data={"x": x, "y": y})
        y_all = np.concatenate([tensors[cid]["train"][1], tensors[cid]["test"][1]])
        stats.append([[int(k), int(n)] for k, n in zip(*np.unique(y_all, return_counts=True))])
    config = {"num_clients": len(ids), "num_classes": int(manifest["num_classes"]), "non_iid": True, "balance": False,
              "partition": "dir", "Size of samples for labels in clients": stats, "alpha": 0.1, "batch_size": 10,
              "fedrepro": {"partition_id": manifest["partition_id"], "spec": manifest.get("spec"),
                           "mean": manifest["mean"], "std": manifest["std"],
                           "normalisation": "fedrepro.engine.data.to_split"}}
    (tmp / "config.json").write_text(json.dumps(config))
    shutil.rmtree(dataset_dir, ignore_errors=True)
    os.replace(tmp, dataset_dir)
    return config


def read_pfllib_client(dataset_dir: Path, idx: int, is_train: bool) -> dict:
    """PFLlib's system/utils/data_utils.py read_data, re-implemented (for checks and tests)."""
    path = dataset_dir / ("train" if is_train else "test") / f"{idx}.npz"
    with open(path, "rb") as fh:
        return np.load(fh, allow_pickle=True)["data"].tolist()


def prepare_data(args, exp: dict) -> tuple[dict, list, Path]:
    """Partition (cached in <work>/shards) and export to <work>/pfllib/dataset/<NAME>."""
    from fedrepro.data.datasets import load_dataset, prepare_dataset
    from fedrepro.data.shards import load_partition, write_partition

    part = exp["partitions"][0]
    shard_dir = args.work / "shards" / part["id"]
    if not (shard_dir / "manifest.json").exists():
        raw_root = Path(args.raw_root) if args.raw_root else args.work / "raw" / args.dataset
        prepare_dataset(args.dataset, raw_root)
        write_partition(load_dataset(args.dataset, raw_root), part["spec"], shard_dir)
    manifest, shards = load_partition(shard_dir)
    small = {c["id"]: c["sizes"]["train"] for c in manifest["clients"] if c["sizes"]["train"] < PFLLIB_FLAGS["batch_size"]}
    if small:
        print(f"[parity] note: clients {small} (id: train samples) have fewer train samples than one batch: with "
              "drop_last PFLlib gives them no local step (fedrepro trains them on their one incomplete batch); PFLlib's "
              "SCAFFOLD divides by their zero batches "
              "(clientscaffold.py update_yc: ZeroDivisionError), Per-FedAvg's one-step evaluation and FedPAC's statistics "
              "read a batch from their empty loader (clientperavg.py train_one_step: StopIteration; clientpac.py "
              "statistics_extraction: UnboundLocalError); --fraction 0.15 gives every client a batch",
              file=sys.stderr)
    dataset_dir = args.work / "pfllib" / "dataset" / pfllib_dataset_name(part["id"])
    stamp = dataset_dir / "config.json"
    if not stamp.exists() or read_json(stamp).get("fedrepro", {}).get("partition_id") != part["id"]:
        print(f"[parity] exporting partition {part['id']} to PFLlib's format in {dataset_dir}", file=sys.stderr)
        export_pfllib(manifest, shards, dataset_dir)
    return manifest, shards, dataset_dir


def pfllib_dataset_name(partition_id: str) -> str:
    # main.py picks FedAvgCNN(in_features=1, num_classes, dim=1024) when "MNIST" is in the name
    # (and read_client_data treats it as images unless "News"/"Shakespeare" is in it).
    return f"FashionMNIST_fedrepro_{partition_id}"


# --------------------------------------------------------------------------------------------
# PFLlib side
# --------------------------------------------------------------------------------------------


def source_hash(system_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(system_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(system_dir)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def stage_pfllib(checkout: Path, work: Path) -> tuple[Path, str]:
    """Copy the checkout's system/ folder, unchanged, to <work>/pfllib/system (recopied when
    the checkout's sources change); PFLlib's ../dataset and ../results then resolve in the
    work dir and the checkout is never written to."""
    src = checkout / "system"
    if not (src / "main.py").is_file():
        raise SystemExit(f"--pfllib {checkout}: no system/main.py there (expected a PFLlib checkout)")
    digest = source_hash(src)
    dst = work / "pfllib" / "system"
    stamp = work / "pfllib" / "system.sha"
    if not dst.exists() or not stamp.exists() or stamp.read_text().strip() != digest:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        stamp.write_text(digest + "\n")
    return dst, digest


_TRIAL = re.compile(r"=+ Running time: (\d+)th =+")
_ROUND = re.compile(r"-+Round number: (\d+)-+")
_ACC = re.compile(r"^Average(?:d)? Test Accuracy: ([-+0-9.eE]+|nan)\s*$")
_TIME = re.compile(r"^-{25,}(?: time cost -{25,})? ([0-9.]+(?:[eE][-+]?\d+)?)\s*$")


def parse_pfllib_stdout(text: str) -> dict[int, dict]:
    """PFLlib's stdout -> {trial: {"evals": [{round, series, acc}], "budget": [s per iteration]}}.

    Structure (serverbase.py and every server's train()): "Running time: <t>th" opens a
    trial; each iteration prints "Round number: <i>", an "Evaluate ..." header, then
    "Averaged Test Accuracy: <acc>" (pFedMe: "Average Test Accuracy", via print_), and
    ends with the iteration's wall time ('-'*25 'time cost' '-'*25 <s>, or '-'*50 <s>).
    An evaluation after the loop (FedBABU's fine-tuned models) gets round "final"."""
    trials: dict[int, dict] = {}
    trial, rnd, series, in_loop = None, None, None, False
    for raw in text.splitlines():
        line = raw.strip()
        m = _TRIAL.search(line)
        if m:
            trial, rnd, series, in_loop = int(m.group(1)), None, None, False
            trials[trial] = {"evals": [], "budget": []}
            continue
        if trial is None:
            continue
        m = _ROUND.search(line)
        if m:
            rnd, in_loop = int(m.group(1)), True
            continue
        head = line.strip("-").strip()
        if head.startswith("Evaluate "):
            series = head
            continue
        if line.startswith("Best accuracy."):
            in_loop = False
            continue
        m = _ACC.match(line)
        if m and series is not None:
            trials[trial]["evals"].append({"round": rnd if in_loop else "final", "series": series, "acc": float(m.group(1))})
            continue
        m = _TIME.match(line)
        if m:
            trials[trial]["budget"].append(float(m.group(1)))
    return trials


def pfllib_flags(device: str = "cpu") -> dict:
    """PFLlib's flags on `device` (part of its cache key: CPU and GPU runs are cached apart)."""
    return {**PFLLIB_FLAGS, "device": device}


def pfllib_command(python: str, algo: str, args: tuple, dataset: str, rounds: int, times: int, goal: str,
                   device: str = "cpu") -> list[str]:
    flags = {**pfllib_flags(device), "dataset": dataset, "algorithm": algo, "global_rounds": rounds, "times": times,
             "goal": goal, **dict(args)}
    cmd = [python, "-u", "main.py"]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def pfllib_key(run: P, dataset: str, rounds: int, src: str, device: str = "cpu") -> str:
    return key_of({"algo": run.algo, "args": run.args, "flags": pfllib_flags(device), "dataset": dataset, "rounds": rounds,
                   "pfllib_src": src})


def pfllib_cache_path(args, run: P, dataset: str, src: str):
    key = pfllib_key(run, dataset, args.rounds, src, args.device)
    return key, lambda s: args.work / "cache" / "pfllib" / f"{slug(run.algo)}__{key}__seed{s}.json"


def pfllib_failures(args, run: P, dataset: str, src: str) -> list[str]:
    """The recorded failures (last error line of the log) of the seeds without a result."""
    _, path = pfllib_cache_path(args, run, dataset, src)
    return sorted({path(s).with_suffix(".failed").read_text().strip() for s in args.seeds
                   if not path(s).exists() and path(s).with_suffix(".failed").exists()})


def run_pfllib(args, run: P, seeds: list[int], dataset: str, system_dir: Path, src: str) -> dict[int, dict]:
    """PFLlib results for `seeds` (= trials), from the cache or by running main.py -t max+1."""
    key, path = pfllib_cache_path(args, run, dataset, src)
    rerun = args.rerun in ("pfllib", "both")
    missing = [s for s in seeds if rerun or not path(s).exists()]
    if missing:
        times = max(missing) + 1
        cmd = pfllib_command(args.pfllib_python, run.algo, run.args, dataset, args.rounds, times, f"parity{key}", args.device)
        log = args.work / "logs" / "pfllib" / f"{slug(run.algo)}__{key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        print(f"[parity] PFLlib {run.algo} {dict(run.args)} trials 0..{times - 1}: {' '.join(cmd[2:])}", file=sys.stderr)
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=system_dir, stdout=fh, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        parsed = parse_pfllib_stdout(text)
        print(f"[parity]   exit {proc.returncode}, {wall:.0f} s, log {log}", file=sys.stderr)
        for s in missing:
            tr = parsed.get(s)
            if proc.returncode != 0 or tr is None or not tr["evals"]:
                lines = [ln for ln in text.splitlines() if ln.strip()]
                tail = "\n".join(lines[-15:])
                print(f"[parity]   PFLlib {run.algo} trial {s} FAILED; log tail:\n{tail}", file=sys.stderr)
                path(s).parent.mkdir(parents=True, exist_ok=True)
                path(s).with_suffix(".failed").write_text((lines[-1] if lines else f"exit {proc.returncode}") + "\n")
                continue
            path(s).with_suffix(".failed").unlink(missing_ok=True)
            budget = tr["budget"]
            rec = {"framework": "pfllib", "algo": run.algo, "args": dict(run.args), "seed": s, "trial": s,
                   "rounds": args.rounds, "key": key, "command": cmd[2:], "evals": tr["evals"], "budget": budget,
                   "s_per_round": float(np.mean(budget[1:])) if len(budget) > 1 else float("nan"),
                   "process_wall_s": wall, "trials_in_process": times, "log": str(log)}
            write_json(path(s), rec)
    return {s: read_json(path(s)) for s in seeds if path(s).exists()}


def pfllib_value(rec: dict, row: Row, rounds: int) -> float | None:
    want = "final" if row.at == "final" else rounds
    hits = [e["acc"] for e in rec["evals"] if e["series"] == row.series and e["round"] == want]
    if not hits:
        found = sorted({e["series"] for e in rec["evals"]})
        raise KeyError(f"row {row.name}: PFLlib printed no '{row.series}' at round {want}; series found: {found}")
    return hits[-1]


# --------------------------------------------------------------------------------------------
# fedrepro side
# --------------------------------------------------------------------------------------------


def fedrepro_label(run: F) -> str:
    return slug(run.method + ("_" + key_of([run.hparams, run.training], 6) if run.hparams or run.training else ""))


def experiment_config(args, runs: list[F]) -> dict:
    return {
        "experiment": "parity_pfllib",
        "datasets": {args.dataset: {"model": {"name": "fedavg_cnn"}}},
        "partitions": {"pfllib_dir0.1": partition_config(20, args.fraction)},
        "methods": {fedrepro_label(r): {"method": r.method, "hparams": dict(r.hparams),
                                        **({"training": dict(r.training)} if r.training else {})} for r in runs},
        "seeds": list(args.seeds),
        "training": {"rounds": args.rounds, **FEDREPRO_TRAINING, **json.loads(getattr(args, "fedrepro_training", "{}"))},
    }


def fedrepro_cache_path(args, cells: list[dict], run: F):
    """Cache file of a seed: keyed by the resolved cell (method defaults included) minus its seed."""
    cell0 = copy.deepcopy(cells[0])
    cell0.pop("seed")
    device = getattr(args, "device", "cpu")
    key = key_of(cell0 if device == "cpu" else {**cell0, "device": device})  # CPU keys as before
    label = fedrepro_label(run)
    return key, lambda s: args.work / "cache" / "fedrepro" / f"{label}__{key}__seed{s}.json"


def run_fedrepro(args, cells_list: list[dict], manifest: dict, shards: list, run: F, seeds: list[int]) -> dict[int, dict]:
    import torch

    from fedrepro.engine.data import load_clients
    from fedrepro.engine.engine import Engine
    from fedrepro.engine.run import set_determinism

    cells = {c["seed"]: c for c in cells_list}
    key, path = fedrepro_cache_path(args, cells_list, run)
    rerun = args.rerun in ("fedrepro", "both")
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # PFLlib's side runs with OMP_NUM_THREADS=1
    for s in seeds:
        if path(s).exists() and not rerun:
            continue
        cell = cells[s]
        print(f"[parity] fedrepro {run.method} {dict(run.hparams)} {dict(run.training) or ''} seed {s}", file=sys.stderr)
        set_determinism(cell["training"]["deterministic"])
        clients = load_clients(manifest, shards, device)  # fresh client state per cell
        t0 = time.perf_counter()
        try:
            metrics = Engine(cell, manifest, clients, device, progress=False).run()
        except Exception as exc:  # a broken method must not stop the other rows
            print(f"[parity]   fedrepro {run.method} seed {s} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        wall = time.perf_counter() - t0
        res = metrics["resources"]
        curves = {k: v["weighted_mean"] for k, v in metrics["curves"].items() if isinstance(v, dict) and "weighted_mean" in v}
        rec = {"framework": "fedrepro", "method": run.method, "hparams": cell["hparams"], "training": cell["training"],
               "seed": s, "rounds": args.rounds, "key": key, "status": metrics["status"],
               "final": {k: v["weighted_mean"] for k, v in metrics.get("summary", {}).items() if k.endswith("_acc")},
               "curves": {"round": metrics.get("curves", {}).get("round"), **curves},
               "train_time_s": res["train_time_s"], "eval_time_s": res["eval_time_s"], "wall_time_s": res["wall_time_s"],
               "process_wall_s": wall}
        # personalized models scored only at the last round: that is PFLlib's after-loop personalization
        every = cell["training"].get("personal_eval_every")
        after_loop = res["personal_eval_time_s"] if every is not None and every >= args.rounds else 0.0
        rec["after_loop_s"] = after_loop
        rec["s_per_round"] = (res["train_time_s"] + res["eval_time_s"] - after_loop) / args.rounds
        print(f"[parity]   {wall:.0f} s: " + ", ".join(f"{k} {v:.4f}" for k, v in rec["final"].items()), file=sys.stderr)
        write_json(path(s), rec)
    return {s: read_json(path(s)) for s in seeds if path(s).exists()}


def fedrepro_value(rec: dict, row: Row) -> float | None:
    return rec["final"].get(f"{row.column}_acc")


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def flag(diff: float, sd_p: float, sd_f: float) -> str:
    """'≠' when |diff| > max(2 x the larger std over seeds, 0.01); the 1-point floor keeps a
    near-deterministic pair (std ~ 0) from being flagged for test-set noise."""
    if any(math.isnan(v) for v in (diff, sd_p, sd_f)):
        return "?"
    return "≠" if abs(diff) > max(2 * max(sd_p, sd_f), 0.01) else ""


def fmt(m: float, s: float) -> str:
    return "n/a" if math.isnan(m) else f"{100 * m:.2f} ± {100 * s:.2f}"


def speed_stats(pairs: list[tuple[float, float]]) -> dict:
    """PFLlib's and fedrepro's s/round over the timed pairs (means) and the speed ratio: the mean of
    the pairs' ratios PFLlib ÷ fedrepro, with their min and max (NaN where a side has no time)."""
    ratios = [p / f for p, f in pairs if f and not math.isnan(p) and not math.isnan(f)]
    mean = lambda v: float(np.mean(v)) if v else math.nan  # noqa: E731
    return {"pfllib_s_per_round": mean([p for p, _ in pairs if not math.isnan(p)]),
            "fedrepro_s_per_round": mean([f for _, f in pairs if not math.isnan(f)]),
            "speed_ratio": mean(ratios), "speed_ratio_min": min(ratios, default=math.nan),
            "speed_ratio_max": max(ratios, default=math.nan), "speed_pairs": len(ratios)}


def summarize_rows(rows: list[Row], pres: dict, fres: dict, rounds: int, failures: dict | None = None,
                   speeds: dict[str, list[tuple[float, float]]] | None = None) -> list[dict]:
    """One dict per row; `speeds` (row name -> per pair (PFLlib, fedrepro) s/round) defaults to the
    one pair in `pres`/`fres`."""
    out = []
    failures = failures or {}
    for row in rows:
        p_recs, f_recs = pres.get(row.pfllib, {}), fres.get(row.fedrepro, {})
        p_acc, f_acc = [], []
        for rec in p_recs.values():
            try:
                p_acc.append(pfllib_value(rec, row, rounds))
            except KeyError as exc:
                print(f"[parity] {exc}", file=sys.stderr)
        f_acc = [fedrepro_value(r, row) for r in f_recs.values()]
        pm, ps = mean_std(p_acc)
        fm, fs = mean_std(f_acc)
        pairs = (speeds or {}).get(row.name) or [(mean_std([r["s_per_round"] for r in p_recs.values()])[0],
                                                   mean_std([r["s_per_round"] for r in f_recs.values()])[0])]
        diff = fm - pm
        out.append({"row": row.name, "pfllib_algo": row.pfllib.algo, "pfllib_args": dict(row.pfllib.args),
                    "fedrepro_method": row.fedrepro.method, "fedrepro_hparams": dict(row.fedrepro.hparams),
                    "fedrepro_training": dict(row.fedrepro.training),
                    "metric": f"P '{row.series}'{' (after loop)' if row.at == 'final' else ''} ↔ F test/{row.column}",
                    "hparams": hp_text(row), "pfllib_seeds": sorted(p_recs), "fedrepro_seeds": sorted(f_recs),
                    "pfllib_acc": p_acc, "fedrepro_acc": f_acc, "pfllib_mean": pm, "pfllib_std": ps,
                    "fedrepro_mean": fm, "fedrepro_std": fs, "diff": diff, "flag": flag(diff, ps, fs),
                    **speed_stats(pairs), "speed_pairs_s_per_round": pairs,
                    "pfllib_failed": failures.get(row.pfllib, []) if not p_acc else []})
    return out


def markdown(summary: list[dict], args) -> str:
    head = ("| method | metric compared | hparams (P = PFLlib, F = fedrepro) | PFLlib acc % | fedrepro acc % | diff (pp) "
            "| flag | PFLlib s/round | fedrepro s/round | speed ratio |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in summary:
        d = "n/a" if math.isnan(r["diff"]) else f"{100 * r['diff']:+.2f}"
        pt = "n/a" if math.isnan(r["pfllib_s_per_round"]) else f"{r['pfllib_s_per_round']:.2f}"
        ft = "n/a" if math.isnan(r["fedrepro_s_per_round"]) else f"{r['fedrepro_s_per_round']:.2f}"
        sr = "n/a" if math.isnan(r["speed_ratio"]) else f"{r['speed_ratio']:.2f}×"
        if r.get("speed_pairs", 1) > 1:
            sr += f" ({r['speed_ratio_min']:.2f}–{r['speed_ratio_max']:.2f}, {r['speed_pairs']} pairs)"
        pa = fmt(r["pfllib_mean"], r["pfllib_std"])
        if r.get("pfllib_failed"):
            pa = "failed: " + "; ".join(r["pfllib_failed"]).replace("|", "/")
        lines.append(f"| {r['row']} | {r['metric']} | {r['hparams']} | {pa} | "
                     f"{fmt(r['fedrepro_mean'], r['fedrepro_std'])} | {d} | {r['flag']} | {pt} | {ft} | {sr} |")
    cap = (f"Fashion-MNIST, PFLlib Dir(0.1), 20 clients, fraction {args.fraction}, {args.rounds} rounds, "
           f"seeds {' '.join(map(str, args.seeds))}; accuracy = test-size-weighted mean after {args.rounds} rounds, "
           "mean ± sample std over seeds; flag ≠: |diff| > max(2 × larger std, 1 pp); speed ratio = PFLlib s/round ÷ "
           "fedrepro s/round" + (f", mean over {args.pairs} pairs timed back to back (range in brackets); s/round: means "
                                 "over the pairs" if getattr(args, "pairs", 1) > 1 else "") + ".\n\n")
    return cap + head + "\n".join(lines) + "\n"


def output_path(args, ext: str) -> Path:
    return args.work / f"parity_f{args.fraction:g}_r{args.rounds}.{ext}"


def write_outputs(args, summary: list[dict], pres: dict, fres: dict) -> None:
    write_json(output_path(args, "json"), {"protocol": {"rounds": args.rounds, "seeds": args.seeds, "fraction": args.fraction,
                                                         "pfllib_flags": pfllib_flags(args.device), "fedrepro_training": FEDREPRO_TRAINING},
                                            "rows": summary,
                                            "pfllib_runs": [r for runs in pres.values() for r in runs.values()],
                                            "fedrepro_runs": [r for runs in fres.values() for r in runs.values()]})
    with open(output_path(args, "csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["framework", "run", "seed", "round", "series", "acc", "s_per_round"])
        for run, recs in pres.items():
            for s, rec in sorted(recs.items()):
                for e in rec["evals"]:
                    w.writerow(["pfllib", run.algo + json.dumps(dict(run.args), sort_keys=True), s, e["round"], e["series"],
                                e["acc"], rec["s_per_round"]])
        for run, recs in fres.items():
            for s, rec in sorted(recs.items()):
                rounds = rec["curves"].get("round") or []
                for name, vals in rec["curves"].items():
                    if name == "round":
                        continue
                    for r, v in zip(rounds, vals):
                        w.writerow(["fedrepro", run.method + json.dumps(dict(run.hparams + run.training), sort_keys=True),
                                    s, r, f"test/{name.replace('_acc', '')}", v, rec["s_per_round"]])
    output_path(args, "md").write_text(markdown(summary, args))


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pfllib", type=Path, required=True, help="a PFLlib checkout (only read: its system/ is copied)")
    ap.add_argument("--pfllib-python", default="python", help="PFLlib's interpreter (default: python on PATH)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedrepro-parity"), help="work dir: data, runs, cache, outputs")
    ap.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                    help="rows to run (case-insensitive row names or PFLlib -algo names); default all: "
                         + ", ".join(r.name for r in ROWS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.1,
                    help="every client keeps this fraction of its data, class by class (1 = full scale)")
    ap.add_argument("--only", choices=("pfllib", "fedrepro"), default=None, help="run one side only (the table shows what is cached)")
    ap.add_argument("--rerun", choices=("pfllib", "fedrepro", "both"), default=None, help="recompute one side's cached results")
    ap.add_argument("--pairs", type=int, default=1,
                    help="time every run N times, PFLlib's runs then fedrepro's, both recomputed from the second pair on; "
                         "the speed ratio is the mean of the N pairs' ratios, with their range (one method per invocation "
                         "keeps each pair back to back)")
    ap.add_argument("--fedrepro-training", default="{}", metavar="JSON",
                    help='extra fedrepro training keys, e.g. \'{"channels_last": true}\' (cached apart: they change the cell)')
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="both sides on this device (PFLlib's -dev; fedrepro's engine; cuda: benchmarks/gpu_session.sh)")
    ap.add_argument("--dataset", default="fmnist", help=argparse.SUPPRESS)
    ap.add_argument("--raw-root", default=None, help="raw data folder (default <work>/raw/<dataset>)")
    args = ap.parse_args(argv)
    if not 0 < args.fraction <= 1:
        ap.error("--fraction must be in (0, 1]")
    if args.pairs < 1 or (args.pairs > 1 and args.only):
        ap.error("--pairs must be >= 1, and a pair needs both sides (no --only)")
    args.work = args.work.resolve()
    args.pfllib = args.pfllib.resolve()
    args.seeds = sorted(set(args.seeds))

    rows = ROWS
    if args.methods:
        want = {m.lower() for m in args.methods}
        rows = [r for r in ROWS if r.name.lower() in want or r.pfllib.algo.lower() in want
                or r.name.split(" (")[0].lower() in want]
        unknown = want - {r.name.lower() for r in rows} - {r.pfllib.algo.lower() for r in rows} \
            - {r.name.split(" (")[0].lower() for r in rows}
        if unknown:
            ap.error(f"unknown --methods {sorted(unknown)}; rows: {', '.join(r.name for r in ROWS)}")

    t_start = time.perf_counter()
    f_runs = list(dict.fromkeys(r.fedrepro for r in rows))
    p_runs = list(dict.fromkeys(r.pfllib for r in rows))
    from fedrepro.config import resolve_experiment

    exp = resolve_experiment(experiment_config(args, [F("fedavg")]))  # the partition
    cells: dict[F, list[dict]] = {}
    for run in f_runs:  # one at a time: a method whose hparams do not resolve only loses its rows
        try:
            cells[run] = resolve_experiment(experiment_config(args, [run]))["cells"]
        except Exception as exc:
            print(f"[parity] fedrepro {run.method} {dict(run.hparams)}: {type(exc).__name__}: {exc}", file=sys.stderr)
    manifest, shards, dataset_dir = prepare_data(args, exp)
    dataset = dataset_dir.name
    system_dir, src = stage_pfllib(args.pfllib, args.work)

    pres: dict[P, dict] = {}
    fres: dict[F, dict] = {}
    failures: dict[P, list[str]] = {}
    speeds: dict[str, list[tuple[float, float]]] = {r.name: [] for r in rows}  # per row: (PFLlib, fedrepro) s/round per pair
    for pair in range(args.pairs):
        if pair:
            print(f"[parity] pair {pair + 1} of {args.pairs}", file=sys.stderr)
            args.rerun = "both"
        for run in p_runs:
            if args.only == "fedrepro":
                _, path = pfllib_cache_path(args, run, dataset, src)
                pres[run] = {s: read_json(path(s)) for s in args.seeds if path(s).exists()}
            else:
                pres[run] = run_pfllib(args, run, args.seeds, dataset, system_dir, src)
            failures[run] = pfllib_failures(args, run, dataset, src)
        for run in f_runs:
            if run not in cells:
                fres[run] = {}
            elif args.only == "pfllib":
                fres[run] = load_fedrepro_cache(args, cells[run], run)
            else:
                fres[run] = run_fedrepro(args, cells[run], manifest, shards, run, args.seeds)
        for row in rows:
            speeds[row.name].append(tuple(mean_std([r["s_per_round"] for r in recs.values()])[0]
                                          for recs in (pres.get(row.pfllib, {}), fres.get(row.fedrepro, {}))))

    summary = summarize_rows(rows, pres, fres, args.rounds, failures, speeds)
    write_outputs(args, summary, pres, fres)
    print(markdown(summary, args))
    print(f"[parity] outputs: {output_path(args, '{md,json,csv}')}; this invocation took "
          f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr)


def load_fedrepro_cache(args, cells: list[dict], run: F) -> dict[int, dict]:
    _, path = fedrepro_cache_path(args, cells, run)
    return {s: read_json(path(s)) for s in args.seeds if path(s).exists()}


if __name__ == "__main__":
    main()
