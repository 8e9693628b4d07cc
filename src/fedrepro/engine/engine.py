"""The engine of one cell: a façade over the engine's rooms.

One `Engine` runs one cell. It holds the cell's state: the model object (reused for every
client, with parameters copied in and out), the client data tensors on the device, the
method, the client-sampling schedule (a function of the seed only, identical for every
method), the batch-stream positions and the round. What is done with that state lives in
the modules beside this one, each owning one job (docs/architecture.md): the round loop
(loop.py), local training (training.py), per-round evaluation and the untrained-client rule
(evaluation.py), the beyond-protocols (beyond.py), the t-SNE picture (embedding.py),
checkpoints (checkpoints.py), the metrics record (record.py), optimizers and schedules
(optim.py), sampling (sampling.py), memory layout (layout.py), the round progress
(round_progress.py), the final model and the fine-tuning rows scored from it (finetune.py).
The Engine's methods are the verbs methods and the loop call; each hands its work to its module. Randomness is drawn from seeds derived from (seed, purpose, round,
client), never from one running stream, so a run resumed from a checkpoint ends exactly where
an uninterrupted run ends.

The names other code imports from here (`use_layout`, `lr_at`, `sampling_schedule`, ...)
are re-exported from their modules.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ..io import derive_seed
from ..methods import METHODS, Method, Update, select
from ..methods.base import Batch, ClientFit, FitResult  # the engine <-> method contract (re-exported here)
from ..models import SplitModel, build_model
from . import beyond, checkpoints, embedding as tsne, evaluation, loop, training
from .checkpoints import CheckpointRejected
from .data import AUGMENTATIONS, Client, Split, _normaliser
from .evaluation import UNTRAINED_RULES
from .layout import channels_last, use_layout
from .loop import TrainingDiverged
from .optim import OPTIMIZERS, lars, lr_at
from .record import build_metrics, metrics_cell, summaries
from .sampling import sampling_schedule, trained_rounds
from .vectorized import vectorize_blocker

__all__ = ["AUGMENTATIONS", "Batch", "CheckpointRejected", "Client", "ClientFit", "Engine", "FitResult", "OPTIMIZERS",
           "Split", "TrainingDiverged", "UNTRAINED_RULES", "Update", "build_metrics", "channels_last", "lars", "lr_at",
           "metrics_cell", "sampling_schedule", "summaries", "trained_rounds", "use_layout"]

Params = dict[str, torch.Tensor]


class Engine:
    def __init__(self, cell: dict[str, Any], manifest: dict[str, Any], clients: list[Client], device: torch.device,
                 checkpoint: Path | None = None, progress: bool = True, official_test: Split | None = None,
                 method_class: type[Method] | None = None):
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
        self._stream = 0  # position in the current client's batch streams (training.batches)
        self._batch_purpose = "batches"  # "eval-batches" while personalized models are computed
        self._pooled_cache: dict[str, torch.Tensor] = {}
        torch.manual_seed(derive_seed(self.seed, "model-init"))
        self.model: SplitModel = build_model(cell["model"]["name"], manifest["sample_shape"], self.num_classes, cell["model"].get("params")).to(device)
        use_layout(self.model, self.training.get("channels_last", False), device)  # absent in older cells: as before
        self.augment = AUGMENTATIONS[self.training["augment"]]
        self.normalisation = _normaliser(manifest, device)  # (mean, std) per channel: what the data tensors were scaled by
        # method_class: a derived fine-tuning row's method (finetune.py), else the cell's registered one
        self.method: Method = (method_class or METHODS.entry(cell["method"]).obj)(self, dict(cell["hparams"]))
        for name, module in self.method.extra_modules().items():  # a method's own modules (SSL projector, target network)
            self.model.add_module(name, module.to(device))
        self.schedule = sampling_schedule(len(self.clients), self.training["participation"], self.training["rounds"], self.seed)
        self.untrained_rule = (cell.get("evaluation") or {}).get("untrained", "personalize")
        if self.untrained_rule not in UNTRAINED_RULES:
            raise ValueError(f"evaluation.untrained has value {self.untrained_rule!r}; allowed: {', '.join(UNTRAINED_RULES)}")
        self.trained_in = trained_rounds(self.schedule, [c.id for c in self.clients])
        self.initial_params = self.get_params()  # the seeded initialisation: the 'initial' rule's model
        self.vectorized = self._vectorized()
        self._vectorizing = False  # inside a vectorized round's local updates (loop.train_round)
        self.compile = self.training.get("compile", False)  # absent in older cells: eager, as before
        self._compiled: torch.nn.Module | None = None
        self._streams: dict[int, int] = {}  # per-client batch stream positions of a vectorized round
        self.personal_eval_time = 0.0  # seconds of evaluate() spent on personalized models (resources)
        # after the last round: the server and random state and the records, for the final-model file (finetune.py)
        self.final_state: dict[str, Any] | None = None
        self.final_records: tuple[list, dict] | None = None

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
    def get_params(self, prefixes: Iterable[str] = ("",)) -> Params:
        """A copy of the model's parameters and buffers whose names start with `prefixes`; a frozen
        part (`SplitModel.frozen_prefixes`, a pretrained backbone) is never among them."""
        frozen = self.model.frozen_prefixes
        return {k: v.detach().clone() for k, v in select(self.model.state_dict(), prefixes).items()
                if not (frozen and k.startswith(frozen))}

    def set_params(self, params: Params) -> None:
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

    # -- local training (training.py) ---------------------------------------------------------
    def batches(self, client: Client, **kw: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return training.batches(self, client, **kw)

    def optimizer(self, params: Iterable[torch.Tensor], lr: float | None = None) -> torch.optim.Optimizer:
        return training.optimizer(self, params, lr)

    def fit(self, client: Client, **kw: Any) -> FitResult:
        return training.fit(self, client, **kw)

    def compiled_forward(self) -> torch.nn.Module:
        return training.compiled_forward(self)

    def fit_many(self, clients: list[Client], starts: list[Params], **options: Any) -> list[ClientFit]:
        return training.fit_many(self, clients, starts, **options)

    def forward_with(self, params: Params, x: torch.Tensor, features: bool = False) -> torch.Tensor:
        return training.forward_with(self, params, x, features)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return training.features(self, x)

    def finetune_head(self, params: Params, client: Client, **kw: Any) -> Params:
        return training.finetune_head(self, params, client, **kw)

    def fit_head(self, z: torch.Tensor, y: torch.Tensor, **kw: Any) -> None:
        return training.fit_head(self, z, y, **kw)

    # -- evaluation (evaluation.py, beyond.py, embedding.py) -------------------------------------
    def predict(self, params: Params, x: torch.Tensor) -> np.ndarray:
        return evaluation.predict(self, params, x)

    def _probs(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return evaluation.probs(self, params, x)

    def has_trained(self, client: Client) -> bool:
        return evaluation.has_trained(self, client)

    def scored_by(self, client: Client) -> str:
        return evaluation.scored_by(self, client)

    def evaluate(self, personal: bool = True) -> dict[str, Any]:
        return evaluation.evaluate(self, personal)

    def personal_model(self, client: Client, how: str) -> Params | None:
        return evaluation.personal_model(self, client, how)

    def evaluate_beyond(self, record: dict[str, Any]) -> dict[str, Any]:
        return beyond.evaluate_beyond(self, record)

    def embedding(self, ids: list[int]) -> dict[str, Any] | None:
        return tsne.embedding(self, ids)

    # -- checkpoints (checkpoints.py) -------------------------------------------------------
    def cell_key(self) -> str:
        return checkpoints.cell_key(self)

    def identity(self) -> dict[str, Any]:
        return checkpoints.identity(self)

    def save_checkpoint(self, history: list, per_round: dict) -> None:
        checkpoints.save(self, history, per_round)

    def load_checkpoint(self) -> tuple[int, list, dict] | None:
        return checkpoints.load(self)

    # -- the loop (loop.py) -------------------------------------------------------------------
    def train_round(self, r: int) -> tuple[list[Update], int, int]:
        return loop.train_round(self, r)

    def run(self) -> dict[str, Any]:
        return loop.run(self)
