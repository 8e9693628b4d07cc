"""The round loop: the federated protocol of one cell, from setup to metrics.json.

Owns the order of the verbs (docs/architecture.md): the method's `setup`, then per round the
sampled clients' `broadcast` and local updates (all at once in a vectorized round, else client
after client, each from its own seed), the divergence check, `aggregate`, the bytes sent and
the mean training loss, evaluation every `eval_every` rounds, checkpoints every
`checkpoint_every` rounds; after the last round the beyond-protocols, the t-SNE picture and
the metrics record. It calls the rooms that do each step directly (evaluation, checkpoints,
beyond, embedding, final_model, record), never through the façade; the façade's verbs are the
methods'. Every function takes the cell (engine.py's `Engine`).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any

import torch

from ..federation import TrainingDiverged, Update, payload_bytes
from ..io import derive_seed
from . import beyond, checkpoints, embedding as tsne, evaluation
from .record import accuracies, build_metrics, summaries
from .round_progress import RoundProgress


def _checked(update: Update, cid: int, r: int) -> Update:
    if not math.isfinite(update.loss):
        raise TrainingDiverged(f"training loss of client {cid} is {update.loss} in round {r} (diverged)", r)
    return update


def _settled(updates: list[Update]) -> list[Update]:
    """The updates with their losses as numbers: those a vectorized fit left on the device (lever
    `device_losses`) are read back at once, the round's one host synchronisation of its local updates."""
    on_device = [u for u in updates if isinstance(u.loss, torch.Tensor)]
    if on_device:
        for u, value in zip(on_device, torch.stack([u.loss for u in on_device]).tolist()):
            u.loss = value
    return updates


def train_round(engine, r: int) -> tuple[list[Update], int, int]:
    """The local updates of round `r`'s sampled clients (before aggregation), and the bytes
    sent up and down: all at once where the round is vectorized (`Method.local_updates`, whose
    `fit_many` then runs as one computation), else one client after another (`Method.local_update`)."""
    method, cids = engine.method, engine.schedule[r - 1]
    sampled = [engine.clients[cid] for cid in cids]
    if engine.vectorized:
        payloads = [method.broadcast(c) for c in sampled]
        down = sum(payload_bytes(p) for p in payloads)
        with engine.streams.vectorized_round():
            updates = [_checked(u, cid, r) for u, cid in zip(_settled(method.local_updates(sampled, payloads)), cids)]
    else:
        updates, down = [], 0
        for cid, client in zip(cids, sampled):
            payload = method.broadcast(client)
            down += payload_bytes(payload)
            engine.streams.start_client()
            torch.manual_seed(derive_seed(engine.seed, "local-update", r, cid))
            updates.append(_checked(method.local_update(client, payload), cid, r))
    up = sum(payload_bytes(u.params) + payload_bytes(u.extras) for u in updates)
    return updates, up, down


def run(engine) -> dict[str, Any]:
    """Train the cell (resuming from its checkpoint where one is believed) and return its metrics."""
    t = engine.training
    rounds = t["rounds"]
    t0 = time.perf_counter()
    train_time = eval_time = 0.0
    engine.method.setup()
    history: list[dict] = []
    per_round = {"up": [], "down": [], "train_loss": []}  # bytes and mean training loss of every round
    start = 1
    resumed = checkpoints.load(engine)
    if resumed is not None:
        done, history, per_round = resumed
        start = done + 1
        print(f"[fedrepro] resuming from the checkpoint after round {done}", file=sys.stderr)
    bar = RoundProgress(rounds, start - 1, engine.progress, engine.cell)
    for r in range(start, rounds + 1):
        engine.round = r
        t1 = time.perf_counter()
        updates, up, down = train_round(engine, r)
        engine.method.aggregate(updates)
        n = sum(u.num_samples for u in updates)
        train_loss = sum(u.loss * u.num_samples for u in updates) / max(n, 1)
        per_round["up"].append(up)
        per_round["down"].append(down)
        per_round["train_loss"].append(train_loss)
        t2 = time.perf_counter()
        train_time += t2 - t1
        if r == rounds:  # the state a fine-tuning row of this cell starts its scoring from (finetune.py)
            engine.final.take_state(engine)
        if r % t["eval_every"] == 0 or r == rounds:
            record = evaluation.evaluate(engine, personal=r % (t.get("personal_eval_every") or 1) == 0 or r == rounds)
            record["train_loss"] = train_loss
            history.append(record)
            eval_time += time.perf_counter() - t2
            stats = summaries(record, "test", [len(c.test) for c in engine.clients])
            bar.update(r, accuracies(stats), train_loss, stats, up, down)
        else:
            bar.update(r, None, train_loss, None, up, down)
        if r % t["checkpoint_every"] == 0 and r < rounds:
            checkpoints.save(engine, history, per_round)
    bar.close()
    engine.final.records = (history, per_round)  # what a derived fine-tuning row re-scores (final_model.save_final)
    t3 = time.perf_counter()
    scores_beyond = beyond.evaluate_beyond(engine, history[-1])
    embedding = tsne.embedding(engine, (engine.cell.get("evaluation") or {}).get("embed_clients") or [])
    eval_time += time.perf_counter() - t3
    resources = {
        "wall_time_s": time.perf_counter() - t0,
        "train_time_s": train_time,
        "eval_time_s": eval_time,
        # the part of the rounds' evaluations that made and scored the personalized models (fine-tuning, probes)
        "personal_eval_time_s": engine.scoring.personal_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if engine.device.type == "cuda" else None,
        "device": str(engine.device),
        "resumed_from_round": start - 1,
    }
    trained = [[r for r in engine.trained_in[c.id] if r <= rounds] for c in engine.clients]
    metrics = build_metrics(engine.cell, engine.clients, history, per_round, resources, scores_beyond, engine.unseen,
                            trained, engine.untrained_rule, engine.method.report())
    if embedding is not None:
        metrics["embedding"] = embedding
    bar.track.final(metrics)
    return metrics
