"""Derived fine-tuning rows: a finished cell's final model, fine-tuned and scored in a job of its own.

A fine-tuning row (fedavg_ft, fedprox_ft, scaffold_ft: a method wrapped by
methods/_finetune.with_head_finetuning) whose fine-tuned column is scored only after the last
round trains exactly what its base method's cell trains. So the base cell keeps its final model
(`FINAL_MODEL` beside its metrics.json: the method's server state and torch's random state after
the last aggregation, and the evaluation records) and the row only re-scores it (`finetune_cell`):
the last round's evaluation under the fine-tuning method, the protocols after training, the
metrics record. Its metrics.json is the one training the row in full writes, byte for byte
(`resources` aside: this job's own cost).

Why that is exact: the global model is the base's (the rounds never read the personalized
column); fine-tuning draws its batches from (seed, "finetune", round, client), a not-yet-trained
client's personalization from (seed, "untrained-...", round, client); the rounds before the last
score no personalized model, so their records are the base's global scores with an empty
personalized column; the one state of training the scoring reads besides the server's is torch's
global random state (dropout in an unseen client's personalization), saved after the last
aggregation. Rows scored during training (a per-round fine-tuned curve) stay cells that train.
"""

from __future__ import annotations

import functools
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..registry import ConfigError
from .final_model import FINAL_MODEL, kept_final, read_final  # noqa: F401  (FINAL_MODEL: the workflow's name for the file)

# -- which rows are derived ---------------------------------------------------------------------------

def finetune_class(cell: dict[str, Any]) -> type | None:
    """The fine-tuning method of `cell` (a class made by with_head_finetuning), or None: a registered
    one (fedavg_ft, ...), or for a "+FT" row (config `methods.<label>.finetune`) its method's."""
    from ..methods import METHODS

    cls = METHODS.get(cell["method"])
    if "finetune" in cell:
        return _plus_ft(cls)
    return cls if getattr(cls, "finetune_base", None) is not None else None


@functools.lru_cache(maxsize=None)
def _plus_ft(base: type) -> type:
    from ..methods import with_head_finetuning

    return with_head_finetuning(base, name=f"{base.name}+ft", summary=f"{base.name} + per-client fine-tuning of the head",
                                paper=f"{base.paper} + fine-tuning as in pFL-Bench")


def personal_rounds(training: dict[str, Any]) -> list[int]:
    """The evaluated rounds before the last whose personalized column is scored (loop.run's rule)."""
    every, k = training["eval_every"], training.get("personal_eval_every") or 1
    return [r for r in range(1, training["rounds"]) if r % every == 0 and r % k == 0]


def base_problem(cell: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Why `cell` cannot be derived from the cell `base`'s final model, or None: `cell` must be a
    fine-tuning method of `base`'s method, scored only at its last round, and otherwise `base`
    (same data, model, seed, evaluation, hyper-parameters other than the ft_* ones, training other
    than how often personalized models are scored), neither tuned nor swept."""
    from ..methods import FINETUNE_HPARAMS

    cls = finetune_class(cell)
    if cls is None:
        return f"method {cell['method']!r} is not a fine-tuning method (methods/_finetune.py)"
    if cls.finetune_base.name != base["method"]:
        return f"method {cell['method']!r} fine-tunes {cls.finetune_base.name!r}, not the base cell's {base['method']!r}"
    if "finetune" in cell and cell["finetune"] != base["label"]:
        return f"it fine-tunes label {cell['finetune']!r}, not {base['label']!r}"
    early = personal_rounds(cell["training"])
    if early and "finetune" not in cell:  # a "+FT" row is scored after training only, whatever its training says
        return f"it scores its fine-tuned column during training (rounds {early[:5]}): training.personal_eval_every"
    for key in ("tuned", "sweep", "validation"):
        if key == "sweep" and "finetune" in cell and key not in base:
            continue  # a "+FT" row's sweep varies its ft_* hparams only (fedrepro.config), not the base's model
        if key in cell or key in base:
            return f"a {key} cell trains its own model"
    same = {"hparams": lambda c: {k: v for k, v in c["hparams"].items() if k not in FINETUNE_HPARAMS},
            "training": lambda c: {k: v for k, v in c["training"].items() if k != "personal_eval_every"}}
    for key in sorted(set(cell) | set(base)):
        if key in ("label", "method", "finetune") or (key == "sweep" and "finetune" in cell):
            continue  # (a "+FT" row's sweep: its ft_* hparams, compared above)
        a, b = (same[key](cell), same[key](base)) if key in same else (cell.get(key), base.get(key))
        if a != b:
            return f"its {key} differs from the base cell's"
    return None


# -- the job --------------------------------------------------------------------------------------

def _finished(cell: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The row's finished metrics.json at `path` (of this very cell: its identity, hash included),
    or None: what an experiment trained before rows were derived already holds."""
    from ..custody import EXPECTED_FIELDS, read_metrics
    from ..io import short_hash

    if not path.is_file():
        return None
    expected = {k: cell[k] for k in EXPECTED_FIELDS[:5]} | {"cell_key": short_hash(cell)}
    try:
        doc = read_metrics(path, expected)
    except ConfigError:  # damaged or another cell's: the row is computed again
        return None
    return doc if doc.get("status") == "ok" and doc.get("identity") is not None else None


def derived_bases(cells: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The rows of an experiment that are derived, keyed (dataset, partition, label, seed), each with
    its base cell: the first cell of the same dataset, partition and seed it can be derived from
    (`base_problem`). A label is derived in all its cells or in none (the workflow picks the job
    kind by label)."""
    key = lambda c: (c["dataset"], c["partition"], c["label"], str(c["seed"]))
    out: dict[tuple, dict[str, Any]] = {}
    undecided = {}
    for c in cells:
        if finetune_class(c) is None:
            continue
        base = next((b for b in cells if b is not c and (b["dataset"], b["partition"], b["seed"]) ==
                     (c["dataset"], c["partition"], c["seed"]) and base_problem(c, b) is None), None)
        undecided.setdefault(c["label"], []).append((c, base))
    for label, pairs in undecided.items():
        if all(base is not None for _, base in pairs):
            out.update({key(c): base for c, base in pairs})
        elif any("finetune" in c for c, _ in pairs):  # made by fedrepro.config from its base label: never happens
            c = next(c for c, base in pairs if base is None)
            raise ConfigError(f"config key 'methods.{label}.finetune': no cell of label {c['finetune']!r} for "
                              f"{c['dataset']}/{c['partition']}/seed{c['seed']} to fine-tune")
    return out


def _before_last(record: dict[str, Any], n: int) -> dict[str, Any]:
    """A base record of a round before the last as the fine-tuning row records it: the base's
    global scores, no personalized model scored (loop.run's `personal=False` rounds)."""
    out = {k: v for k, v in record.items() if not k.endswith("/personal")}
    for key in [k for k in record if k.endswith("/global")]:
        out[key.replace("/global", "/personal")] = {"acc": [math.nan] * n, "f1": [math.nan] * n}
    return out


def finetune_cell(cell: dict, base: dict, shards_dir: str | Path, out_dir: str | Path, final_model: str | Path,
                  device: str = "auto", threads: int | None = None, base_key: str | None = None) -> dict[str, Any]:
    """Write the metrics.json and provenance.json of the fine-tuning row `cell` from the final
    model of its base cell `base` (`base_key`: the hash the base's files carry, where it is not
    the hash of `base`); its provenance.json records the final model's sha256. Where the file is
    missing: refused if the base's provenance.json records one (deleted or moved); else the base was
    trained before final models were kept, and the row is trained in full."""
    from ..custody import cell_identity, write_metrics
    from ..io import clean_stale, short_hash, write_json_atomic
    from ..provenance import collect
    from . import beyond, embedding as tsne, evaluation
    from .engine import Engine
    from .record import build_metrics
    from .run import open_cell, train_cell

    problem = base_problem(cell, base)
    if problem:
        raise ConfigError(f"cell {cell['label']}/seed{cell['seed']} cannot be derived from {base['label']}/seed{base['seed']}: {problem}")
    final_model, out_dir = Path(final_model), Path(out_dir)
    absent = not final_model.exists() and not final_model.is_symlink()
    retrain = f"delete its metrics.json, or snakemake --forcerun {final_model.parent / 'metrics.json'}"
    recorded = kept_final(final_model) if absent else None
    if recorded is not None:
        raise ConfigError(f"final model {final_model} is missing: its cell {base['label']}/seed{base['seed']} kept one "
                          f"(sha256 {recorded['sha256'][:12]}..., its provenance.json), since deleted or moved; retrain that "
                          f"cell to regenerate it ({retrain})")
    if absent and "finetune" in cell:
        raise ConfigError(f"final model {final_model} is absent: its cell {base['label']}/seed{base['seed']} was trained "
                          f"before final models were kept (its provenance.json records none); retrain it ({retrain})")
    if absent:  # a base trained before final models were kept
        kept = _finished(cell, out_dir / "metrics.json")
        if kept is not None:
            print(f"[fedrepro] {final_model} is absent; {out_dir}/metrics.json is already this row's (trained in full): "
                  "kept", file=sys.stderr)
            return kept
        print(f"[fedrepro] {final_model} is absent (its cell was trained before final models were kept: its "
              "provenance.json records none): "
              f"training {cell['label']} in full", file=sys.stderr)
        return train_cell(cell, shards_dir, out_dir, device=device, threads=threads, progress=False)
    clean_stale(out_dir)
    t0 = time.perf_counter()
    manifest, clients, dev, determinism, official = open_cell(cell, shards_dir, device, threads)
    engine = Engine(cell, manifest, clients, dev, progress=False, official_test=official, method_class=finetune_class(cell))
    engine.method.setup()  # the clients' initial states (a not-yet-trained client's), the server's layout, then the base's server
    state, sha256 = read_final(final_model, cell_identity(base, manifest, base_key or short_hash(base)), engine)
    print(f"[fedrepro] fine-tuning cell {cell['label']}/seed{cell['seed']} from {final_model} on {dev}", file=sys.stderr)
    engine.method.server = state["server"]
    engine.round = rounds = cell["training"]["rounds"]
    history = [_before_last(h, len(engine.clients)) for h in state["history"][:-1]]
    torch.set_rng_state(state["rng"]["cpu"].cpu())  # (read onto `dev`; torch takes a random state on the CPU)
    if dev.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), dev)
    t1 = time.perf_counter()
    record = evaluation.evaluate(engine, personal=True) | {"train_loss": state["history"][-1]["train_loss"]}
    history.append(record)
    scores_beyond = beyond.evaluate_beyond(engine, record)
    embedding = tsne.embedding(engine, (cell.get("evaluation") or {}).get("embed_clients") or [])
    resources = {
        "wall_time_s": time.perf_counter() - t0,
        "train_time_s": 0.0,  # trained by the base cell
        "eval_time_s": time.perf_counter() - t1,
        "personal_eval_time_s": engine.scoring.personal_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
        "device": str(dev),
        "resumed_from_round": 0,
        "finetuned_from": base["label"],  # how the row was made: the tables' note (report/tables.finetune_note)
    }
    trained = [[r for r in engine.trained_in[c.id] if r <= rounds] for c in engine.clients]
    metrics = build_metrics(cell, engine.clients, history, state["per_round"], resources, scores_beyond, engine.unseen,
                            trained, engine.untrained_rule, engine.method.report())
    if embedding is not None:
        metrics["embedding"] = embedding
    identity = cell_identity(cell, manifest)
    metrics["identity"] = identity
    derived = {"derived_from": {"identity": state["identity"], "final_model": str(final_model), "sha256": sha256}}
    write_json_atomic(out_dir / "provenance.json", collect(cell, manifest, dev, determinism) | {"identity": identity} | derived)
    write_metrics(out_dir / "metrics.json", metrics)
    return metrics
