"""The federated loop, shared by every method.

One `Engine` runs one cell. It owns the model object (reused for every client, with
parameters copied in and out), the client data tensors on the device, the client
sampling sequence (a function of the seed only, identical for every method), the
learning-rate schedule, evaluation every k rounds, checkpoints and bookkeeping.
Randomness is drawn from seeds derived from (seed, purpose, round, client), never from
one running stream, so a run resumed from a checkpoint ends exactly where an
uninterrupted run ends.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..custody import cell_identity, identity_mismatch, set_aside
from ..io import atomic_path, derive_seed, short_hash
from ..metrics import STATS, accuracy, harmonic_mean, macro_f1, summarize, type_summary
from ..methods import METHODS, Method, Update, payload_bytes, select, weighted_average
from ..methods.base import Batch, FitResult  # the engine <-> method contract (re-exported here)
from ..models import SplitModel, build_model
from ..registry import show
from ..progress import CellProgress
from ..tracking import Tracker
from .data import AUGMENTATIONS, Client, Split, _normaliser
from .vectorized import ClientFit, compiled_model, fit_many, replays_cuda_graphs, vectorize_blocker


def lars(params, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """lightly's LARS with the trust coefficient 0.02 of Calibre's paper-era config (eta_lars,
    methods.md §2.5); biases and normalisation weights (1-D tensors) are excluded from the layer-wise
    adaptation and the weight decay, as there."""
    from lightly.utils.lars import LARS

    params = list(params)
    groups = [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return LARS([g for g in groups if g["params"]], lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=0.02)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, momentum, weight_decay: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay),
    "lars": lars,
    "adam": lambda params, lr, momentum, weight_decay: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay),
    "adamw": lambda params, lr, momentum, weight_decay: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
}


# How a client that has not trained yet is scored (config `evaluation.untrained`):
#   personalize  the method's new-client personalization (`Method.personalize_unseen`: one local
#                update from the broadcast, then its personal model), as for held-out clients;
#   initial      the common seeded initial model (PFLlib's clients before their first round);
#   exclude      left out of every aggregate (its scores are None in metrics.json).
# The rule applies to every method alike: the personal column of a method with personalized
# models, and (exclude only) the global column, so every row is computed on the same clients.
UNTRAINED_RULES = ("personalize", "initial", "exclude")


class CheckpointRejected(Exception):
    """Why a checkpoint is not resumed from (Engine.load_checkpoint moves it aside)."""


class TrainingDiverged(RuntimeError):
    def __init__(self, reason: str, round: int):
        super().__init__(reason)
        self.reason, self.round = reason, round


def lr_at(schedule: dict[str, Any], base_lr: float, round: int) -> float:
    """Learning rate of a (1-based) round: constant, multistep (gamma or explicit values) or cosine."""
    name = schedule["name"]
    if name == "constant":
        return base_lr
    if name == "multistep":
        passed = sum(round > m for m in schedule["milestones"])
        if schedule.get("values"):
            return schedule["values"][passed]
        return base_lr * schedule["gamma"] ** passed
    if name == "cosine":
        total = schedule["total_rounds"]
        return schedule["min_lr"] + 0.5 * (base_lr - schedule["min_lr"]) * (1 + math.cos(math.pi * (round - 1) / max(1, total)))
    raise ValueError(f"unknown lr schedule {name!r}")


def trained_rounds(schedule: list[list[int]], ids: list[int]) -> dict[int, list[int]]:
    """Client id -> the (1-based) rounds in which the schedule samples it (`schedule` indexes `ids`)."""
    out: dict[int, list[int]] = {cid: [] for cid in ids}
    for r, sampled in enumerate(schedule, 1):
        for i in sampled:
            out[ids[i]].append(r)
    return out


def sampling_schedule(num_clients: int, participation: float | int, rounds: int, seed: int) -> list[list[int]]:
    """The clients of every round, drawn once from the seed: the same for every method."""
    # An integer is a count of clients, a float a fraction of them (1 = one client, 1.0 = all).
    m = participation if isinstance(participation, int) else max(1, int(round(participation * num_clients)))
    m = min(m, num_clients)
    rng = np.random.default_rng(derive_seed(seed, "client-sampling"))
    return [sorted(rng.choice(num_clients, size=m, replace=False).tolist()) for _ in range(rounds)]


def channels_last(setting: bool | str, device: torch.device) -> bool:
    """Whether the model's 4-d weights take the channels-last layout: `training.channels_last`
    true/false, or "auto" = on the CPU only (measured faster there for every conv model of the
    registry, benchmarks/layouts.py; on GPUs FP32 NHWC is not known to pay)."""
    return device.type == "cpu" if setting == "auto" else bool(setting)


def use_layout(model: torch.nn.Module, setting: bool | str, device: torch.device) -> torch.nn.Module:
    """`model` (in place) in the layout `training.channels_last` = `setting` gives it on `device`:
    NHWC convolution weights where `channels_last` says so (faster CPU (oneDNN) and tensor-core
    convolutions; the same initial values, results equal to floating-point tolerance, not bit
    for bit). The engine and the benchmarks' plain loops lay models out through this."""
    return model.to(memory_format=torch.channels_last) if channels_last(setting, device) else model


class Engine:
    def __init__(self, cell: dict[str, Any], manifest: dict[str, Any], clients: list[Client], device: torch.device,
                 checkpoint: Path | None = None, progress: bool = True, official_test: Split | None = None):
        self.cell = cell
        self.training = cell["training"]
        self.seed = int(cell["seed"])
        self.device = device
        self.clients = [c for c in clients if not c.unseen]  # the federation; sampling indexes this list
        self.unseen = [c for c in clients if c.unseen]  # never train; evaluated after training
        self._by_id = {c.id: c for c in clients}
        self.official_test = official_test
        self.manifest = manifest
        self.num_classes = int(manifest["num_classes"])
        self.checkpoint_path = checkpoint
        self._identity: dict[str, Any] | None = None
        self.progress = progress
        self.round = 0
        self._stream = 0
        self._batch_purpose = "batches"  # "eval-batches" while personalized models are computed
        self._pooled_cache: dict[str, torch.Tensor] = {}
        torch.manual_seed(derive_seed(self.seed, "model-init"))
        self.model: SplitModel = build_model(cell["model"]["name"], manifest["sample_shape"], self.num_classes, cell["model"].get("params")).to(device)
        use_layout(self.model, self.training.get("channels_last", False), device)  # absent in older cells: as before
        self.augment = AUGMENTATIONS[self.training["augment"]]
        self.normalisation = _normaliser(manifest, device)  # (mean, std) per channel: what the data tensors were scaled by
        entry = METHODS.entry(cell["method"])
        self.method: Method = entry.obj(self, dict(cell["hparams"]))
        for name, module in self.method.extra_modules().items():  # a method's own modules (SSL projector, target network)
            self.model.add_module(name, module.to(device))
        self.schedule = sampling_schedule(len(self.clients), self.training["participation"], self.training["rounds"], self.seed)
        self.untrained_rule = (cell.get("evaluation") or {}).get("untrained", "personalize")
        if self.untrained_rule not in UNTRAINED_RULES:
            raise ValueError(f"evaluation.untrained has value {self.untrained_rule!r}; allowed: {', '.join(UNTRAINED_RULES)}")
        self.trained_in = trained_rounds(self.schedule, [c.id for c in self.clients])
        self.initial_params = self.get_params()  # the seeded initialisation: the 'initial' rule's model
        self.vectorized = self._vectorized()
        self.compile = self.training.get("compile", False)  # absent in older cells: eager, as before
        self._compiled: torch.nn.Module | None = None
        self._streams: dict[int, int] = {}  # per-client batch stream positions of a vectorized round
        self.personal_eval_time = 0.0  # seconds of evaluate() spent on personalized models (resources)

    def _vectorized(self) -> bool:
        """Whether rounds run the sampled clients' local updates as one vectorized computation:
        asked for (`training.vectorize`), the method opts in (its own class sets `vectorized =
        True`: not inherited, since a subclass may change the local update) and the model allows it."""
        if not self.training.get("vectorize", False):  # absent in older cells: sequential, as before
            return False
        if not type(self.method).__dict__.get("vectorized", False):
            print(f"[fedrepro] training.vectorize: method {self.cell['method']} has no vectorized local update; "
                  "running the sequential one", file=sys.stderr)
            return False
        blocker = vectorize_blocker(self.model)
        if blocker is not None:
            print(f"[fedrepro] training.vectorize: {blocker}; running the sequential local updates", file=sys.stderr)
            return False
        return True

    def client(self, client_id: int) -> Client:
        return self._by_id[client_id]

    # -- parameters -------------------------------------------------------------------
    def get_params(self, prefixes: Iterable[str] = ("",)) -> dict[str, torch.Tensor]:
        """A copy of the model's parameters and buffers whose names start with `prefixes`; a frozen
        part (`SplitModel.frozen_prefixes`, a pretrained backbone) is never among them."""
        frozen = self.model.frozen_prefixes
        return {k: v.detach().clone() for k, v in select(self.model.state_dict(), prefixes).items()
                if not (frozen and k.startswith(frozen))}

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        """Copy `params` into the one model object (names not given are left as they are)."""
        state = self.model.state_dict()
        with torch.no_grad():
            for k, v in params.items():
                state[k].copy_(v)

    @property
    def lr(self) -> float:
        opt = self.training["optimizer"]
        return lr_at(self.training["lr_schedule"], opt["lr"], max(self.round, 1))

    def generator(self, *keys: int | str) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, *keys))

    # -- local training -------------------------------------------------------------------
    def batches(self, client: Client, *, epochs: int | None = None, batch_size: int | None = None,
                split: str = "train", max_steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) mini-batches of a client's split: index slices of the tensors already on
        the device, in a seeded order (one stream per round, client and call), augmented
        on the device. Methods with their own inner loops (pFedMe, Per-FedAvg, APFL) use
        this; `fit` is built on it."""
        t = self.training
        epochs = t["local_epochs"] if epochs is None else epochs
        batch_size = batch_size or t["batch_size"]
        data: Split = getattr(client, split)
        n = len(data)
        g = self.generator(self._batch_purpose, self.round, client.id, self._stream)
        self._stream += 1
        stop = n - n % batch_size if t["drop_last"] and n >= batch_size else n
        steps = 0
        for _ in range(epochs):
            # non_blocking: no host-device synchronisation between a client's steps (the order is a
            # fresh pageable CPU tensor, staged by the copy itself); a no-op on the CPU
            perm = torch.randperm(n, generator=g).to(self.device, non_blocking=True)
            for start in range(0, stop, batch_size):
                if max_steps is not None and steps >= max_steps:
                    return
                idx = perm[start : start + batch_size]
                x, y = data.x[idx], data.y[idx]
                yield (self.augment(x, g) if self.augment is not None else x), y
                steps += 1

    def optimizer(self, params: Iterable[torch.Tensor], lr: float | None = None) -> torch.optim.Optimizer:
        """A fresh optimizer of the configured kind over `params` at the round's learning rate."""
        cfg = self.training["optimizer"]
        return OPTIMIZERS[cfg["name"]](list(params), self.lr if lr is None else lr, cfg["momentum"], cfg["weight_decay"])

    def fit(
        self,
        client: Client,
        *,
        epochs: int | None = None,
        trainable: Iterable[str] = ("",),
        lr: float | None = None,
        batch_size: int | None = None,
        split: str = "train",
        max_steps: int | None = None,
        loss_fn: Callable[[Batch], torch.Tensor] | None = None,
        before_step: Callable[[SplitModel], None] | None = None,
    ) -> FitResult:
        """Train the model object in place on one client's split with a fresh optimizer.

        Only parameters whose names start with `trainable` are updated (the rest are
        frozen: FedRep, FedBABU, ...). `loss_fn(batch)` replaces cross-entropy (e.g. to add
        a proximal or contrastive term); `before_step(model)` may edit gradients (SCAFFOLD,
        FedProx); `max_steps` stops early (Per-FedAvg's one-step adaptation).
        """
        trainable = tuple(trainable)
        named = list(self.model.named_parameters())
        params = [p for name, p in named if name.startswith(trainable) and p.requires_grad]
        frozen = [p for name, p in named if not name.startswith(trainable) and p.requires_grad]
        for p in frozen:  # no gradients for the frozen part: cheaper, and the optimizer never sees it
            p.requires_grad_(False)
        opt = self.optimizer(params, lr)
        model = self.model
        model.train()
        # The compiled step replaces the standard forward; a custom loss reads features and logits,
        # and CUDA-graph replays of a partly frozen model were wrong on a GPU (vectorized.py).
        compiled = self.compile and loss_fn is None and not (frozen and replays_cuda_graphs(self.compile, self.device))
        forward = self.compiled_forward() if compiled else None
        total = torch.zeros((), device=self.device)
        seen, steps = 0, 0
        try:
            for x, y in self.batches(client, epochs=epochs, batch_size=batch_size, split=split, max_steps=max_steps):
                if forward is not None:
                    loss = F.cross_entropy(forward(x), y)
                else:
                    feats = model.extractor(x)
                    logits = model.head(feats)
                    loss = F.cross_entropy(logits, y) if loss_fn is None else loss_fn(Batch(x, y, feats, logits))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if before_step is not None:
                    before_step(model)
                opt.step()
                total += loss.detach() * len(y)
                seen += len(y)
                steps += 1
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return FitResult(float(total) / max(seen, 1), steps)

    def compiled_forward(self) -> torch.nn.Module:
        """The model object under `torch.compile` (`training.compile`), built once per cell."""
        if self._compiled is None:
            self._compiled = compiled_model(self.model, self.compile, self.device)
        return self._compiled

    def fit_many(self, clients: list[Client], starts: list[dict[str, torch.Tensor]], **options: Any) -> list[ClientFit]:
        """`fit` for each of `clients` from its own full parameters `starts[i]`, as one vectorized
        computation (engine/vectorized.py); `options` are `fit`'s, the same for every client
        (no `loss_fn`). Returns each client's trained parameters and loss; the model object is
        left as it was."""
        return fit_many(self, clients, starts, self._streams, **options)

    def forward_with(self, params: dict[str, torch.Tensor], x: torch.Tensor, features: bool = False) -> torch.Tensor:
        """The model object's output (or representation) with `params` in place of its
        own, without copying them in: for methods that need a second model in the same
        step (APFL's mixture, MOON's global and previous representations). Gradients flow
        to `params` where they require them."""
        from torch.func import functional_call

        full = {**self.model.state_dict(), **params}
        if features:
            return functional_call(self.model.extractor, {k[len("extractor."):]: v for k, v in full.items() if k.startswith("extractor.")}, (x,))
        return functional_call(self.model, full, (x,))

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Representations of `x` from the model object in eval mode, in chunks."""
        self.model.eval()
        bs = self.training["eval_batch_size"]
        return torch.cat([self.model.extractor(x[i : i + bs]) for i in range(0, len(x), bs)]) if len(x) else x.new_zeros((0, self.model.feature_dim))

    def finetune_head(self, params: dict[str, torch.Tensor], client: Client, *, epochs: int, lr: float, batch_size: int,
                      momentum: float = 0.0, fresh: bool = False) -> dict[str, torch.Tensor]:
        """Fine-tune the head of `params` on the client's frozen train features; return the head.

        The personalization stage of any method: `fresh` starts from the seeded initial head
        (a new linear classifier on a frozen encoder, Calibre's protocol) instead of `params`'s.
        The features are computed once (extractor frozen, eval mode), so this costs one
        forward pass plus the head's own steps. Uses its own random stream, so evaluating
        never changes training.
        """
        self.set_params({**params, **(select(self.initial_params, ("head.",)) if fresh else {})})
        feats = self.features(client.train.x)
        opt = torch.optim.SGD(self.model.head.parameters(), lr=lr, momentum=momentum)
        self.fit_head(feats, client.train.y, epochs=epochs, batch_size=batch_size, opt=opt,
                      g=self.generator("finetune", self.round, client.id))
        return self.get_params(("head.",))

    def fit_head(self, z: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, opt: torch.optim.Optimizer,
                 g: torch.Generator, loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 drop_last: bool = False) -> None:
        """Train the model's head in place on fixed representations `z` (computed once, the
        extractor frozen): index-sliced batches in the order drawn from `g`; `loss_fn(logits,
        z, y)` replaces cross-entropy (FedCRC's KL-guided global head)."""
        head = self.model.head
        head.train()
        n = len(y)
        stop = n - n % batch_size if drop_last and n >= batch_size else n
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g).to(y.device, non_blocking=True)
            for start in range(0, stop, batch_size):
                idx = perm[start : start + batch_size]
                logits = head(z[idx])
                loss = F.cross_entropy(logits, y[idx]) if loss_fn is None else loss_fn(logits, z[idx], y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    @torch.no_grad()
    def predict(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> np.ndarray:
        self.set_params(params)
        self.model.eval()
        bs = self.training["eval_batch_size"]
        out = [self.model(x[i : i + bs]).argmax(1) for i in range(0, len(x), bs)]
        return torch.cat(out).cpu().numpy() if out else np.zeros(0, dtype=np.int64)

    # -- evaluation -----------------------------------------------------------------------
    def _scores(self, y: torch.Tensor, pred: np.ndarray) -> tuple[float, float]:
        yt = y.cpu().numpy()
        return accuracy(yt, pred), macro_f1(yt, pred)

    def _pooled(self, split: str) -> torch.Tensor:
        """All clients' inputs of one split in client order, concatenated once and cached:
        the global model is scored on every client in a single batched pass."""
        if split not in self._pooled_cache:
            self._pooled_cache[split] = torch.cat([getattr(c, split).x for c in self.clients])
        return self._pooled_cache[split]

    def has_trained(self, client: Client) -> bool:
        """Whether `client` has taken part in a round up to the current one."""
        rounds = self.trained_in.get(client.id, [])
        return bool(rounds) and rounds[0] <= self.round

    def scored_by(self, client: Client) -> str:
        """How `client` is scored now: 'trained', or for a client that has not trained yet the
        untrained rule ('personalize', 'initial', 'excluded'; 'global' for a method whose
        only model is the global one, which scores every client)."""
        if self.has_trained(client):
            return "trained"
        if self.untrained_rule == "exclude":
            return "excluded"
        return self.untrained_rule if self.method.has_personal else "global"

    def evaluate(self, personal: bool = True) -> dict[str, Any]:
        """Per-client accuracy and macro-F1 of the global and personalized models on each
        client's own test split (and validation split, where there is one). Clients that have
        not trained yet are scored by the untrained rule (`scored_by`); excluded ones get NaN.
        `personal=False` (a round `training.personal_eval_every` skips): the personalized
        column is NaN for every client, and no personalized model is computed."""
        splits = ["test"] + (["val"] if any(len(c.val) for c in self.clients) else [])
        record: dict[str, Any] = {"round": self.round, "scored_by": [self.scored_by(c) for c in self.clients]}
        keep = [how != "excluded" for how in record["scored_by"]]
        method = self.method
        global_params = method.global_params() if method.has_global else None
        for split in splits:
            if global_params is not None:
                pred = self.predict(global_params, self._pooled(split))
                bounds = np.cumsum([0] + [len(getattr(c, split)) for c in self.clients])
                scores = [self._scores(getattr(c, split).y, pred[a:b]) if k else _NO_SCORE
                          for c, a, b, k in zip(self.clients, bounds[:-1], bounds[1:], keep)]
                record[f"{split}/global"] = {"acc": [s[0] for s in scores], "f1": [s[1] for s in scores]}
        if method.has_personal and not personal:
            for split in splits:
                record[f"{split}/personal"] = {"acc": [math.nan] * len(self.clients), "f1": [math.nan] * len(self.clients)}
        elif method.has_personal:
            t0 = time.perf_counter()
            per = {s: [] for s in splits}
            for c, how in zip(self.clients, record["scored_by"]):
                params = self.personal_model(c, how)
                for split in splits:
                    data = getattr(c, split)
                    per[split].append(_NO_SCORE if params is None else self._scores(data.y, self.predict(params, data.x)))
            for split in splits:
                record[f"{split}/personal"] = {"acc": [s[0] for s in per[split]], "f1": [s[1] for s in per[split]]}
            self.personal_eval_time += time.perf_counter() - t0
        return record

    def personal_model(self, client: Client, how: str) -> dict[str, torch.Tensor] | None:
        """The personalized model that scores `client` (`how` = `scored_by(client)`); None if excluded."""
        if how == "trained":
            return self._personal(client)
        if how == "initial":
            return self.initial_params
        if how == "personalize":
            # The new-client personalization must leave no trace: the client's state is restored
            # and the batches come from a stream of their own, so training is unchanged.
            saved = copy.deepcopy(client.state)
            torch.manual_seed(derive_seed(self.seed, "untrained-personalize", self.round, client.id))
            try:
                return self._personal(client, "untrained-batches")
            finally:
                client.state = saved
        return None

    def _personal(self, client: Client, purpose: str = "eval-batches") -> dict[str, torch.Tensor]:
        """A client's personalized model. Fine-tuning draws its batches from a stream of its own
        per (purpose, round, client): independent of training and of evaluation order."""
        self._batch_purpose, self._stream = purpose, 0
        try:
            return self.method.personal_params(client) if purpose == "eval-batches" else self.method.personalize_unseen(client)
        finally:
            self._batch_purpose = "batches"

    def _mean_personal(self, personal: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        """The train-size-weighted average of the clients' personalized models `personal` (None:
        an excluded client): the "global model" of a method that has none (FedCRC's Table II
        protocol for FedPer/FedRep)."""
        return weighted_average([Update(c.id, c.num_train, p) for c, p in zip(self.clients, personal) if p is not None])

    @torch.no_grad()
    def _probs(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        self.set_params(params)
        self.model.eval()
        bs = self.training["eval_batch_size"]
        return torch.cat([F.softmax(self.model(x[i : i + bs]), 1) for i in range(0, len(x), bs)])

    def global_tests(self) -> dict[str, Split]:
        """The global test sets the cell asked for: the union of the clients' test splits
        and/or the dataset's official test set."""
        out = {}
        for name in self.training["global_test"]:
            if name == "union":
                out[name] = Split(self._pooled("test"), torch.cat([c.test.y for c in self.clients]))
            elif self.official_test is None:
                raise ValueError("global_test 'official' needs a partition with pool: false (its official test set)")
            else:
                out[name] = self.official_test
        return out

    def evaluate_beyond(self, record: dict[str, Any]) -> dict[str, Any]:
        """After the last round: unseen clients and global test data.

        * unseen/global: the global model (or, for a method without one, the average of the
          personalized models) on each unseen client's test split; unseen/personal: the
          method's personalization of the unseen client (`Method.personalize_unseen`).
        * <test set>/global: the global model on the global test set (for a method without
          one, the average of the personalized models' softmax outputs, GRP-FED's protocol
          for Local and LG-FedAvg); <test set>/personal: every client's personalized model on
          it (GRP-FED's generalization G); <test set>/hm: per client, the harmonic mean of its
          own-test score P and G (GRP-FED's L).
        """
        method, out = self.method, {}
        hows = [self.scored_by(c) for c in self.clients]  # after the last round, as in its evaluation
        # the clients' personalized models (None: excluded by the untrained rule), computed once, when needed
        personal: list[dict[str, torch.Tensor] | None] = []
        if method.has_personal and ((self.unseen and not method.has_global) or self.training["global_test"]):
            personal = [self.personal_model(c, how) for c, how in zip(self.clients, hows)]
        if self.unseen:
            g = method.global_params() if method.has_global else self._mean_personal(personal)
            out["unseen/global"] = self._score_clients(g, self.unseen)
            if method.has_personal:
                scores = [self._scores(c.test.y, self.predict(self._personal(c, "unseen-batches"), c.test.x)) for c in self.unseen]
                out["unseen/personal"] = {"acc": [s[0] for s in scores], "f1": [s[1] for s in scores]}
        tests = self.global_tests()
        if not tests:
            return out
        own = record["test/personal" if method.has_personal else "test/global"]
        for name, data in tests.items():
            y = data.y.cpu().numpy()
            probs = [None if p is None else self._probs(p, data.x) for p in personal]
            if method.has_global:
                g_pred = self.predict(method.global_params(), data.x)
            else:
                g_pred = torch.stack([pr for pr in probs if pr is not None]).mean(0).argmax(1).cpu().numpy()
            acc, f1 = accuracy(y, g_pred), macro_f1(y, g_pred)
            out[f"{name}/global"] = {"acc": [acc], "f1": [f1]}
            if personal:
                gen = [_NO_SCORE if pr is None else (accuracy(y, pr.argmax(1).cpu().numpy()), macro_f1(y, pr.argmax(1).cpu().numpy()))
                       for pr in probs]
                out[f"{name}/personal"] = {"acc": [s[0] for s in gen], "f1": [s[1] for s in gen]}
            else:  # a global-only method: every client's model is the global one (GRP-FED's G)
                gen = [_NO_SCORE if how == "excluded" else (acc, f1) for how in hows]
            out[f"{name}/hm"] = {m: [harmonic_mean(p, g[i]) for p, g in zip(own[m], gen)] for i, m in enumerate(("acc", "f1"))}
        return out

    def _score_clients(self, params: dict[str, torch.Tensor], clients: list[Client]) -> dict[str, list[float]]:
        scores = [self._scores(c.test.y, self.predict(params, c.test.x)) for c in clients]
        return {"acc": [s[0] for s in scores], "f1": [s[1] for s in scores]}

    # -- checkpoints ------------------------------------------------------------------------
    def cell_key(self) -> str:
        return short_hash(self.cell)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this cell carries and must match to be resumed from: the cell (its
        hash covers every setting, a tuned cell's selected values included) and its shards."""
        if self._identity is None:  # hashing the manifest once per cell, not per checkpoint
            self._identity = cell_identity(self.cell, self.manifest, self.cell_key())
        return self._identity

    def save_checkpoint(self, history: list, per_round: dict) -> None:
        if self.checkpoint_path is None:
            return
        state = {"identity": self.identity(), "round": self.round, "server": self.method.server,
                 "clients": {c.id: c.state for c in self.clients}, "history": history, "per_round": per_round}
        # through a file object: a full disk is then the OSError ENOSPC that atomic_path names the
        # file for (torch's own file writer reports it as "unexpected pos")
        with atomic_path(self.checkpoint_path) as tmp, open(tmp, "wb") as fh:
            torch.save(state, fh)

    def load_checkpoint(self) -> tuple[int, list, dict] | None:
        """(round, history, per_round) of the checkpoint, with the server and client states restored;
        None when there is none. A checkpoint that is damaged, of another cell or shards, or
        inconsistent is never believed and never blocks: it is moved aside with a warning and the
        cell starts from round 0."""
        path = self.checkpoint_path
        if path is None or not os.path.lexists(path):
            return None
        try:
            state = self._checked_checkpoint(path)
        except CheckpointRejected as exc:
            moved = set_aside(path, str(exc))
            print(f"[fedrepro] warning: checkpoint {path} {exc}; moved aside to {moved.name}, "
                  "the cell starts from round 0", file=sys.stderr)
            return None
        self.method.server = state["server"]
        for c in self.clients:
            c.state = state["clients"].get(c.id, {})
        return state["round"], state["history"], state["per_round"]

    def _checked_checkpoint(self, path: Path) -> dict[str, Any]:
        """The checkpoint's state, or CheckpointRejected saying what is wrong with it."""
        if not path.is_file() or path.is_symlink():
            raise CheckpointRejected("is not a regular file")
        try:
            with warnings.catch_warnings():  # torch warns about foreign pickle protocols: the rejection says enough
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location=self.device, weights_only=True)
        except pickle.UnpicklingError:  # never repeat torch's advice to load it with weights_only=False
            raise CheckpointRejected("holds objects other than tensors and plain containers (refused by "
                                     "torch.load(weights_only=True))") from None
        except Exception as exc:  # truncated, not a zip archive, unreadable: anything torch cannot load
            detail = (str(exc).splitlines() or [""])[0][:120]
            detail = "" if "weights_only" in str(exc) else f": {detail}"
            raise CheckpointRejected(f"cannot be read ({type(exc).__name__}{detail}); it is truncated or damaged") from None
        if not isinstance(state, dict) or not {"identity", "round", "server", "clients", "history", "per_round"} <= set(state):
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise CheckpointRejected(f"is not a fedrepro checkpoint of this version (it has {show(keys)})")
        problem = identity_mismatch(state["identity"], self.identity())
        if problem:
            raise CheckpointRejected(f"belongs to another cell or partition ({problem})")
        done, rounds = state["round"], self.training["rounds"]
        if not isinstance(done, int) or isinstance(done, bool) or not 1 <= done < rounds:
            raise CheckpointRejected(f"has round {show(done)}; allowed: 1 <= round < {rounds}")
        problem = self._history_problem(done, state["history"], state["per_round"])
        if problem:
            raise CheckpointRejected(f"is inconsistent after round {done}: {problem}")
        if not isinstance(state["clients"], dict) or not set(state["clients"]) <= {c.id for c in self.clients}:
            raise CheckpointRejected("has client states of clients this partition does not train")
        return state

    def _history_problem(self, done: int, history: Any, per_round: Any) -> str | None:
        """What is wrong with a checkpoint's records after round `done`, or None: `per_round` has one
        entry per round, and `history` one record per evaluated round (training.eval_every) with
        that round's training loss."""
        if not isinstance(per_round, dict) or any(not isinstance(per_round.get(k), list) or len(per_round[k]) != done
                                                  for k in ("up", "down", "train_loss")):
            return f"per_round must hold {done} values each of up, down and train_loss"
        evaluated = [r for r in range(1, done + 1) if r % self.training["eval_every"] == 0]
        if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
            return "its history is not a list of records"
        got = [h.get("round") for h in history]
        if got != evaluated:
            return f"its history has the evaluated rounds {show(got)}; expected {show(evaluated)}"
        if any(h.get("train_loss") != per_round["train_loss"][h["round"] - 1] for h in history):
            return "its history's training losses differ from per_round's"
        return None

    # -- the loop ------------------------------------------------------------------------------
    def train_round(self, r: int) -> tuple[list[Update], int, int]:
        """The local updates of round `r`'s sampled clients (before aggregation), and the bytes
        sent up and down: one client after another, or all at once where vectorized."""
        updates, up, down = [], 0, 0
        if self.vectorized:  # all sampled clients' local updates in one computation
            sampled = [self.clients[cid] for cid in self.schedule[r - 1]]
            payloads = [self.method.broadcast(c) for c in sampled]
            down = sum(payload_bytes(p) for p in payloads)
            self._streams = {}
            updates = self.method.local_updates(sampled, payloads)
        for i, cid in enumerate(self.schedule[r - 1]):
            if not self.vectorized:
                client = self.clients[cid]
                payload = self.method.broadcast(client)
                down += payload_bytes(payload)
                self._stream = 0
                torch.manual_seed(derive_seed(self.seed, "local-update", r, cid))
                updates.append(self.method.local_update(client, payload))
            update = updates[i]
            if not math.isfinite(update.loss):
                raise TrainingDiverged(f"training loss of client {cid} is {update.loss} in round {r} (diverged)", r)
            up += payload_bytes(update.params) + payload_bytes(update.extras)
        return updates, up, down

    def run(self) -> dict[str, Any]:
        t = self.training
        rounds = t["rounds"]
        t0 = time.perf_counter()
        train_time = eval_time = 0.0
        self.method.setup()
        history: list[dict] = []
        per_round = {"up": [], "down": [], "train_loss": []}  # bytes and mean training loss of every round
        start = 1
        resumed = self.load_checkpoint()
        if resumed is not None:
            done, history, per_round = resumed
            start = done + 1
            print(f"[fedrepro] resuming from the checkpoint after round {done}", file=sys.stderr)
        bar = _progress(rounds, start - 1, self.progress, self.cell)
        for r in range(start, rounds + 1):
            self.round = r
            t1 = time.perf_counter()
            updates, up, down = self.train_round(r)
            self.method.aggregate(updates)
            n = sum(u.num_samples for u in updates)
            train_loss = sum(u.loss * u.num_samples for u in updates) / max(n, 1)
            per_round["up"].append(up)
            per_round["down"].append(down)
            per_round["train_loss"].append(train_loss)
            t2 = time.perf_counter()
            train_time += t2 - t1
            if r % t["eval_every"] == 0 or r == rounds:
                record = self.evaluate(personal=r % (t.get("personal_eval_every") or 1) == 0 or r == rounds)
                record["train_loss"] = train_loss
                history.append(record)
                eval_time += time.perf_counter() - t2
                stats = summaries(record, "test", [len(c.test) for c in self.clients])
                bar.update(r, _accuracies(stats), train_loss, stats, up, down)
            else:
                bar.update(r, None, train_loss, None, up, down)
            if r % t["checkpoint_every"] == 0 and r < rounds:
                self.save_checkpoint(history, per_round)
        bar.close()
        t3 = time.perf_counter()
        beyond = self.evaluate_beyond(history[-1])
        embedding = self.embedding((self.cell.get("evaluation") or {}).get("embed_clients") or [])
        eval_time += time.perf_counter() - t3
        resources = {
            "wall_time_s": time.perf_counter() - t0,
            "train_time_s": train_time,
            "eval_time_s": eval_time,
            # the part of the rounds' evaluations that made and scored the personalized models (fine-tuning, probes)
            "personal_eval_time_s": self.personal_eval_time,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else None,
            "device": str(self.device),
            "resumed_from_round": start - 1,
        }
        trained = [[r for r in self.trained_in[c.id] if r <= rounds] for c in self.clients]
        metrics = build_metrics(self.cell, self.clients, history, per_round, resources, beyond, self.unseen,
                                trained, self.untrained_rule, self.method.report())
        if embedding is not None:
            metrics["embedding"] = embedding
        bar.track.final(metrics)
        return metrics

    def embedding(self, ids: list[int]) -> dict[str, Any] | None:
        """The representations of the test samples of clients `ids` under the model each is scored
        with (its personalized model, else the global one), laid out in 2-D by scikit-learn's t-SNE
        (seeded): {client, label, x, y} per sample. None when no client is asked for."""
        clients = [self._by_id[i] for i in ids if i in self._by_id]
        if not clients:
            return None
        from sklearn.manifold import TSNE

        feats, owner = [], []
        for c in clients:
            if self.method.has_personal:
                params = self._personal(c, "unseen-batches") if c.unseen else self.personal_model(c, self.scored_by(c))
            else:
                params = self.method.global_params()
            if params is None:
                continue
            self.set_params(params)
            feats.append(self.features(c.test.x).flatten(1).cpu())
            owner += [c.id] * len(c.test)
        if not feats:  # every chosen client excluded by the untrained rule
            return None
        z = torch.cat(feats).numpy()
        xy = TSNE(2, perplexity=min(30.0, max(1.0, (len(z) - 1) / 3)), init="pca",
                  random_state=derive_seed(self.seed, "tsne") % 2**31).fit_transform(z)
        labels = torch.cat([self._by_id[i].test.y.cpu() for i in dict.fromkeys(owner)]).tolist()
        return {"client": owner, "label": labels, "x": [round(float(v), 4) for v in xy[:, 0]],
                "y": [round(float(v), 4) for v in xy[:, 1]]}


_NO_SCORE = (math.nan, math.nan)  # accuracy and F1 of a client left out (excluded by the untrained rule)


def _accuracies(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """The evaluated round's test accuracy (weighted over clients) per model kind, of its `summaries`."""
    return {kind: stats[f"{kind}_acc"]["weighted_mean"] for kind in ("global", "personal")
            if f"{kind}_acc" in stats and not math.isnan(stats[f"{kind}_acc"]["weighted_mean"])}


class _progress:
    """Round progress with the current accuracy: a tqdm bar on a terminal, one line per
    round in a log file (Snakemake logs are files); under the workflow also a status file and
    compact console lines (fedrepro.progress), and with tracking on, TensorBoard scalars
    (fedrepro.tracking): side channels that never touch the results."""

    def __init__(self, total: int, initial: int, enabled: bool, cell: dict | None = None):
        self.total, self.enabled, self.last = total, enabled, ""
        self.bar = None
        self.live = CellProgress(cell, total, initial)
        self.track = Tracker(cell, initial)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="rounds", file=sys.stderr)

    def update(self, r: int, acc: dict[str, float] | None, loss: float, stats: dict | None = None, up: int = 0,
               down: int = 0) -> None:
        self.live.update(r, acc, loss)
        self.track.round(r, loss, up, down, stats)
        if not self.enabled:
            return
        if acc:
            self.last = ", ".join(f"{kind} acc {v:.4f}" for kind, v in acc.items()) + f" (evaluated at round {r})"
        text = f"loss {loss:.4f}" + (f", {self.last}" if self.last else "")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"[fedrepro] round {r}/{self.total}: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.live.close()
        if self.bar is not None:
            self.bar.close()


def _clean(values: list[float]) -> list[float | None]:
    return [None if (isinstance(v, float) and math.isnan(v)) else v for v in values]


def _clean_stats(stats: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if math.isnan(v) else v) for k, v in stats.items()}


def summaries(record: dict, split: str, weights: list[int]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in ("global", "personal"):
        key = f"{split}/{kind}"
        if key in record:
            for metric in ("acc", "f1"):
                out[f"{kind}_{metric}"] = summarize(record[key][metric], weights)
    return out


def metrics_cell(cell: dict) -> dict:
    """The cell's identity in metrics.json (what the summary's columns come from): a swept cell
    also carries its swept values (config key methods.<label>.sweep)."""
    return ({k: cell[k] for k in ("experiment", "dataset", "partition", "partition_id", "method", "label", "seed")}
            | {"model": cell["model"]["name"]} | ({"sweep": cell["sweep"]} if "sweep" in cell else {}))


def build_metrics(cell: dict, clients: list[Client], history: list[dict], per_round: dict, resources: dict,
                  beyond: dict | None = None, unseen: list[Client] | None = None,
                  trained: list[list[int]] | None = None, untrained_rule: str = "personalize",
                  method_report: dict | None = None) -> dict[str, Any]:
    """metrics.json: the last round's per-client scores and aggregates (never the best
    round on test data), curves every k rounds, best-on-validation as an extra; after
    training, the scores on unseen clients and global test sets (`Engine.evaluate_beyond`);
    per client the rounds it trained in and how its final scores were obtained."""
    test_sizes = [len(c.test) for c in clients]
    val_sizes = [len(c.val) for c in clients]
    unseen = unseen or []
    beyond = beyond or {}
    last = history[-1]
    final = {kind: ({m: _clean(last[f"test/{kind}"][m]) for m in ("acc", "f1")} if f"test/{kind}" in last else None)
             for kind in ("global", "personal")}
    summary = {k: _clean_stats(v) for k, v in summaries(last, "test", test_sizes).items()}
    # Further kinds, summarised over the clients they score: unseen_{global,personal} over the
    # unseen clients (weighted by test size), <test set>_{global,personal,hm} over the
    # federation's clients (weighted equally: each is scored on the same test set).
    for key, values in beyond.items():
        where, kind = key.split("/")
        weights = [len(c.test) for c in unseen] if where == "unseen" else [1] * len(values["acc"])
        final[f"{where}_{kind}"] = {m: _clean(values[m]) for m in ("acc", "f1")}
        for m in ("acc", "f1"):
            summary[f"{where}_{kind}_{m}"] = _clean_stats(summarize(values[m], weights))
    # Distinct client types (each client holds one domain): Avg, σ_type, σ_client (FedGCR).
    types = [c.client_type for c in clients]
    if clients and None not in types:
        for kind in ("global", "personal"):
            if final[kind] is not None:
                summary[f"{kind}_types"] = _clean_stats(type_summary(last[f"test/{kind}"]["acc"], test_sizes, types))
    curves: dict[str, Any] = {"round": [h["round"] for h in history], "train_loss": [h["train_loss"] for h in history]}
    for name in summaries(last, "test", test_sizes):
        curves[name] = {s: _clean([summaries(h, "test", test_sizes)[name][s] for h in history]) for s in STATS}
    best_val = None
    summary_val = final_val = None
    if "val/global" in last or "val/personal" in last:
        # the last round on the validation split: what hyper-parameter tuning selects by
        summary_val = {k: _clean_stats(v) for k, v in summaries(last, "val", val_sizes).items()}
        final_val = {kind: ({m: _clean(last[f"val/{kind}"][m]) for m in ("acc", "f1")} if f"val/{kind}" in last else None)
                     for kind in ("global", "personal")}
        kind = "personal" if "val/personal" in last else "global"
        val_acc = [summarize(h[f"val/{kind}"]["acc"], val_sizes)["weighted_mean"] for h in history]
        best = int(np.nanargmax(val_acc))
        best_val = {"round": history[best]["round"], "selected_by": f"val {kind} acc weighted_mean",
                    "summary": {k: _clean_stats(v) for k, v in summaries(history[best], "test", test_sizes).items()}}
    return {
        "schema": "fedrepro.metrics/1",
        "cell": metrics_cell(cell),
        "status": "ok",
        "failure": None,
        "rounds": history[-1]["round"],
        "clients": {"ids": [c.id for c in clients], "train_size": [len(c.train) for c in clients],
                    "test_size": test_sizes, "val_size": val_sizes,
                    "unseen_ids": [c.id for c in unseen], "unseen_test_size": [len(c.test) for c in unseen],
                    "trained_rounds": trained, "untrained": sum(1 for t in trained or [] if not t),
                    "untrained_rule": untrained_rule, "scored_by": last.get("scored_by")},
        "final": final,
        "summary": summary,
        "method": method_report or {},
        "best_val": best_val,
        "summary_val": summary_val,
        "final_val": final_val,
        "curves": curves,
        "train_loss_per_round": per_round["train_loss"],
        "communication": {"bytes_up_per_round": per_round["up"], "bytes_down_per_round": per_round["down"],
                          "bytes_up_total": int(sum(per_round["up"])), "bytes_down_total": int(sum(per_round["down"]))},
        "resources": resources,
    }
