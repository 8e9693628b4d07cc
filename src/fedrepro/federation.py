"""The shared vocabulary of a federation: what the methods and the engine's rooms both speak.

A client and its data (`Client`, `Split`), the messages of a round (`Update`, and `payload_bytes`,
their size on the wire), what the engine's local training hands back (`Batch`, `FitResult`,
`ClientFit`), the `Engine` protocol (the tools a method trains with) and the two operations on
parameter sets every side uses (`select`, `weighted_average`).

It lives beside the methods and the engine, not in either: both import it, and it imports
neither of them, no registry and nothing of the engine's rooms (torch only). So a method never
loads the engine, and a room never loads the method registry (which imports every method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

Params = dict[str, torch.Tensor]


class TrainingDiverged(RuntimeError):
    """A cell's training ran into numbers it cannot go on from (a non-finite loss; a method's server
    step that cannot proceed, e.g. FedGCR's GMM on exploded representations): the job writes a failed
    metrics.json with `reason` and `round` instead of a traceback (engine/run.py)."""

    def __init__(self, reason: str, round: int):
        super().__init__(reason)
        self.reason, self.round = reason, round


@dataclass
class Split:
    x: torch.Tensor  # float32, normalised, on the device
    y: torch.Tensor  # int64, on the device

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Client:
    """A client as the engine sees it: its data splits and its persistent state.

    `state` belongs to the method (personal heads, control variates, prototypes, ...);
    the engine checkpoints it with the run.
    """

    id: int
    train: Split
    test: Split
    val: Split
    state: dict[str, Any] = field(default_factory=dict)
    unseen: bool = False  # held out of training, evaluated after it
    groups: dict[str, list[int]] = field(default_factory=dict)  # the per-sample group ids it holds (manifest)
    unlabeled: Split | None = None  # its share of an unlabeled pool (STL-10's), for self-supervised training only
    _ssl_pool: Split | None = field(default=None, repr=False)

    @property
    def ssl_pool(self) -> Split:
        """The data a self-supervised stage trains on: the train split, plus the unlabeled share."""
        if self.unlabeled is None or not len(self.unlabeled):
            return self.train
        if self._ssl_pool is None:
            self._ssl_pool = Split(torch.cat([self.train.x, self.unlabeled.x]), torch.cat([self.train.y, self.unlabeled.y]))
        return self._ssl_pool

    @property
    def num_train(self) -> int:
        return len(self.train)

    @property
    def client_type(self) -> int | None:
        """The client's type (FedGCR's distinct client types): its domain id when all its samples
        come from one domain, else None."""
        ids = self.groups.get("domain") or []
        return int(ids[0]) if len(ids) == 1 else None


@dataclass
class Batch:
    """What a `fit(loss_fn=...)` loss sees for one mini-batch."""

    x: torch.Tensor
    y: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor


@dataclass
class FitResult:
    loss: float  # mean training loss over the samples seen
    steps: int


@dataclass
class ClientFit:
    """One client's result of `fit_many`: its trained parameters and buffers, its loss (in a
    vectorized round with the lever `device_losses`, a 0-d device tensor until the loop reads
    the round's losses at once: pass it on to `Update.loss` as it is)."""

    params: Params
    loss: float | torch.Tensor
    steps: int


@dataclass
class Update:
    """What one client uploads after its local update."""

    client_id: int
    num_samples: int
    params: Params = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # prototypes, control-variate deltas, losses, ...
    loss: float | torch.Tensor = float("nan")  # a number once the loop has it (ClientFit.loss)


class Engine(Protocol):
    """The engine's tools a method uses (implemented by `fedrepro.engine.engine.Engine`)."""

    model: torch.nn.Module
    device: torch.device
    seed: int
    clients: list[Client]
    training: dict[str, Any]
    num_classes: int
    round: int
    initial_params: Params
    lr: float
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None
    normalisation: tuple[torch.Tensor, torch.Tensor]  # per-channel (mean, std) the data tensors were normalised with

    def client(self, client_id: int) -> Client: ...
    def get_params(self, prefixes: Iterable[str] = ("",)) -> Params: ...
    def set_params(self, params: Params) -> None: ...
    def generator(self, *keys: int | str) -> torch.Generator: ...
    def batches(self, client: Client, **kw: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def optimizer(self, params: Iterable[torch.Tensor], lr: float | None = None) -> torch.optim.Optimizer: ...
    def fit(self, client: Client, **kw: Any) -> FitResult: ...
    def fit_many(self, clients: list[Client], starts: list[Params], **kw: Any) -> list[ClientFit]: ...
    def forward_with(self, params: Params, x: torch.Tensor, features: bool = False) -> torch.Tensor: ...
    def features(self, x: torch.Tensor) -> torch.Tensor: ...
    def finetune_head(self, params: Params, client: Client, **kw: Any) -> Params: ...
    def fit_head(self, z: torch.Tensor, y: torch.Tensor, **kw: Any) -> None: ...


def select(params: Params, prefixes: Iterable[str]) -> Params:
    """The entries of `params` whose names start with one of `prefixes` ("" selects all)."""
    prefixes = tuple(prefixes)
    return {k: v for k, v in params.items() if k.startswith(prefixes)} if prefixes else {}


def weighted_average(updates: list[Update], key: str = "params", total: float | None = None) -> Params:
    """FedAvg: sum_i (n_i / sum_j n_j) * theta_i over the updates' tensors; with `total`,
    sum_i (n_i / total) * theta_i (weights that need not sum to 1).

    Integer buffers (BatchNorm's num_batches_tracked) cannot be averaged; the maximum is kept.
    """
    if not updates:
        return {}
    total = float(sum(u.num_samples for u in updates)) if total is None else float(total)
    payloads = [u.params if key == "params" else u.extras[key] for u in updates]
    out: Params = {}
    for name, ref in payloads[0].items():
        tensors = [p[name] for p in payloads]
        if ref.is_floating_point():
            acc = torch.zeros_like(ref)
            for u, t in zip(updates, tensors):
                acc.add_(t, alpha=u.num_samples / total)
            out[name] = acc
        else:
            out[name] = torch.stack(tensors).max(0).values
    return out


def payload_bytes(obj: Any) -> int:
    """Bytes a message would take on the wire: tensors by size, numbers as 8 bytes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    if isinstance(obj, (int, float)):
        return 8
    return 0
