"""The engine of one cell: the cell's state, and a façade that serves the methods.

One `Engine` runs one cell. It holds what the cell is: the model object (reused for every
client, with parameters copied in and out), the client data tensors on the device, the method,
the client-sampling schedule (a function of the seed only, identical for every method) and the
round. Each room beside this one owns its own work and the state that work keeps
(docs/architecture.md): the batch streams and the compiled step are training.py's (`streams`,
`compiled`), the pooled inputs and personalized-model time evaluation.py's (`scoring`), the
checkpoint file and its identity checkpoints.py's (`checkpoint`), the final model
final_model.py's (`final`). The round loop (loop.py) calls the rooms directly.

The Engine's methods are the verbs of the `Engine` protocol (fedrepro.federation): the tools a
method trains with, each handing its work to training.py. Randomness is drawn from seeds derived
from (seed, purpose, round, client), never from one running stream, so a run resumed from a
checkpoint ends exactly where an uninterrupted run ends.

The names other code imports from here (`use_layout`, `lr_at`, `sampling_schedule`, ...)
are re-exported from their modules.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..federation import Batch, Client, ClientFit, FitResult, Split, Update
from ..io import derive_seed
from ..methods import METHODS, Method
from ..models import SplitModel, build_model
from . import loop, training
from .checkpoints import CheckpointFile, CheckpointRejected
from .data import AUGMENTATIONS, normaliser
from .evaluation import UNTRAINED_RULES, Scoring
from .final_model import FinalModel
from .layout import channels_last, use_layout
from .loop import TrainingDiverged
from .optim import OPTIMIZERS, lars, lr_at, round_lr
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
        self.checkpoint = CheckpointFile(checkpoint, cell, manifest)  # checkpoints.py's
        self.progress = progress
        self.round = 0
        self.streams = training.Streams(self.seed)  # the seeded batch streams (training.py's)
        self.scoring = Scoring(self.clients)  # what evaluation keeps across rounds (evaluation.py's)
        self.resident = training.ResidentSplits(self.clients)  # lever resident_batches (training.py's)
        torch.manual_seed(derive_seed(self.seed, "model-init"))
        self.model: SplitModel = build_model(cell["model"]["name"], manifest["sample_shape"], self.num_classes, cell["model"].get("params")).to(device)
        use_layout(self.model, self.training.get("channels_last", False), device)  # absent in older cells: as before
        self.augment = AUGMENTATIONS[self.training["augment"]]
        self.normalisation = normaliser(manifest, device)  # (mean, std) per channel: what the data tensors were scaled by
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
        # the compiled step of training.compile (absent in older cells: eager, as before; training.py's)
        self.compiled = training.CompiledStep(self.training.get("compile", False))
        self.final = FinalModel()  # gathered by the loop for the final-model file (final_model.py's)

    def _vectorized(self) -> bool:
        """Whether rounds run the sampled clients' local updates as one vectorized computation:
        asked for (`training.vectorize`), the method opts in (its own class sets `vectorized =
        True`: not inherited, since a subclass may change the local update) and the model allows it."""
        if not self.training.get("vectorize", False):  # absent in older cells: sequential, as before
            return False
        if not self.method.has_vectorized_update():
            print(f"[fedrepro] training.vectorize: method {self.cell['method']} has no vectorized local update; "
                  "running the sequential one", file=sys.stderr)
            return False
        blocker = vectorize_blocker(self.model)
        if blocker is not None:
            print(f"[fedrepro] training.vectorize: {blocker}; running the sequential local updates", file=sys.stderr)
            return False
        return True

    # -- the verbs of the Engine protocol (fedrepro.federation): what methods call ------------
    def client(self, client_id: int) -> Client:
        return self._by_id[client_id]

    def get_params(self, prefixes: Iterable[str] = ("",)) -> Params:
        return training.get_params(self.model, prefixes)

    def set_params(self, params: Params) -> None:
        training.set_params(self.model, params)

    @property
    def lr(self) -> float:
        return round_lr(self.training, self.round)

    def generator(self, *keys: int | str) -> torch.Generator:
        return self.streams.generator(*keys)

    def batches(self, client: Client, **kw: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return training.batches(self, client, **kw)

    def optimizer(self, params: Iterable[torch.Tensor], lr: float | None = None) -> torch.optim.Optimizer:
        return training.optimizer(self, params, lr)

    def fit(self, client: Client, **kw: Any) -> FitResult:
        return training.fit(self, client, **kw)

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

    # -- the one entry for code outside the engine (scripts, tests): the whole cell ------------
    def run(self) -> dict[str, Any]:
        """Train the cell and return its metrics (loop.run; engine/run.py calls the loop itself)."""
        return loop.run(self)
