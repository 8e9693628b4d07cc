"""The method API: what a federated method supplies to the engine.

The engine owns the loop (rounds, client sampling, evaluation, checkpoints,
bookkeeping; docs/architecture.md shows one round). A method is one small class that
says, like a paper's algorithm box:

* `hparams`         its hyper-parameters with defaults (and their citation),
* `shared`          which parameter prefixes travel ("extractor.", "head.", "" = all),
* `extra_modules()` modules it adds to the model (an SSL projector, a target network),
* `setup()`         its server state (`self.server`, checkpointed by the engine),
* `broadcast()`     what the server sends a sampled client,
* the local update, written ONCE, in one of two forms:
  `local_updates(clients, payloads)` over the sampled clients, training through
  `engine.fit_many` (FedAvg and the methods built on it), or `local_update(client,
  payload)` for one client, training through `engine.fit` and the other tools (methods
  with their own inner loops); either form serves the other (the base class derives it),
* `aggregate()`     how the server folds the round's updates into its state,
* `vectorized`      opt-in (set on the class itself, never inherited) for a method written
  over the sampled clients: with `training.vectorize` the engine then calls its
  `local_updates` once per round and `fit_many` runs the clients' fits as one vectorized
  computation; otherwise the engine calls `local_update` client by client and `fit_many`
  loops over `fit`,
* `global_params()` / `personal_params()` which models are evaluated
  (`personalize_unseen()`: how a client that never trained gets its personal model).

Per-client persistent state lives in `client.state` (checkpointed too), so personal
heads, control variates, discriminators or prototypes need no engine change. The
engine's tools (`self.engine.fit`, `fit_many`, `get_params`, `set_params`, `features`, ...)
train the one shared model object with parameters swapped in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# The contract between the engine and the methods (the engine's tools, the messages of a round) is
# the shared vocabulary of fedrepro.federation: a method imports it, never the engine. Re-exported
# here, where methods and plugins have always imported these names from.
from ..federation import (Batch, Client, ClientFit, Engine, FitResult, Params, TrainingDiverged, Update,  # noqa: F401
                          payload_bytes, select, weighted_average)
from ..registry import Param

#: What a forward pass alone (no gradient: a frozen reference network, features for prototypes or a
#: probe) costs against one training step on the same batch (forward + backward + update): the
#: backward costs about two forwards. The unit of the declared costs below (fedrepro.cost).
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class Passes:
    """The work of one local step (one mini-batch of the client's local epochs), in calibrated units:
    `model` training steps of the whole model at the cell's batch size, `head` steps of the head alone
    on cached features (fedrepro.cost times each from the calibration)."""

    model: float = 1.0
    head: float = 0.0


@dataclass(frozen=True)
class PersonalWork:
    """The work of making one client's personalized model at an evaluation, beyond scoring it:
    `train_epochs` epochs of whole-model training on its train split (at the cell's batch size), and
    `head_epochs` epochs of head steps of `head_batch_size` on its frozen features (one forward over
    the split, then the head's steps: engine.finetune_head)."""

    train_epochs: float = 0.0
    head_epochs: float = 0.0
    head_batch_size: int = 32


class Method:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    hparams: ClassVar[dict[str, Param]] = {}
    shared: ClassVar[tuple[str, ...]] = ("",)  # parameter-name prefixes that are communicated
    has_global: ClassVar[bool] = True  # evaluate a global model
    has_personal: ClassVar[bool] = False  # evaluate a personalized model per client
    models: ClassVar[tuple[str, ...]] = ()  # the models it needs (a model capability it uses); () = any
    # Default tuning space {hparam: [values]} and its citation, for a method kept out of
    # methods/search_spaces.yaml (a plugin); None and no yaml entry: tuning uses the shared lr grid only.
    search_space: ClassVar[dict[str, list] | None] = None
    search_source: ClassVar[str] = ""
    # The class's own local update may run as one vectorized round (engine/vectorized.py). Read from
    # the class's own namespace: a subclass that changes the local update must opt in again.
    vectorized: ClassVar[bool] = False
    # Cost (fedrepro.cost, docs/cost.md): training steps of the whole model per local step. A method that
    # does more per batch declares more (Ditto's second model, SAM's second gradient); one whose work
    # depends on its hyper-parameters overrides `cost_passes_for` (and `cost_personal_for`).
    cost_passes: ClassVar[float] = 1.0

    @classmethod
    def cost_passes_for(cls, hp: dict[str, Any], training: dict[str, Any]) -> Passes:
        """The work of one local step under hyper-parameters `hp` and the resolved `training`."""
        return Passes(cls.cost_passes)

    @classmethod
    def cost_personal_for(cls, hp: dict[str, Any], training: dict[str, Any]) -> PersonalWork:
        """The work of one client's personalized model at an evaluation (none: it is kept, not made)."""
        return PersonalWork()

    @classmethod
    def has_vectorized_update(cls) -> bool:
        """Whether this class's own local update runs as one vectorized round (`vectorized` read from its
        own namespace, never inherited): what the engine runs with `training.vectorize`, and what the
        levers of a vectorized round act on (config.LEVER_TARGETS)."""
        return bool(vars(cls).get("vectorized", False))

    @classmethod
    def check_cell(cls, where: str, hp: dict[str, Any], model: dict[str, Any], partition: dict[str, Any]) -> None:
        """Refuse, before any job runs, a method x model x partition that cannot work (ConfigError)."""
        from ..registry import ConfigError

        if cls.models and model["name"] not in cls.models:
            raise ConfigError(f"config key '{where}': method '{cls.name}' needs the model {' or '.join(cls.models)}; the "
                              f"dataset's model is {model['name']!r}; allowed: {', '.join(cls.models)}")

    @classmethod
    def check_training(cls, where: str, hp: dict[str, Any], training: dict[str, Any]) -> None:
        """Refuse, before any job runs, hyper-parameters that cannot train under the cell's
        resolved `training` (ConfigError naming `where`.<hparam>)."""

    def __init__(self, engine: "Engine", hp: dict[str, Any]):
        self.engine = engine
        self.hp = hp
        self.server: dict[str, Any] = {}

    def extra_modules(self) -> dict[str, torch.nn.Module]:
        """Modules the method adds to the model beside `extractor` and `head` (an SSL projector, a
        target network), by attribute name: they are parameters like the others ("projector." ...)."""
        return {}

    # -- server ---------------------------------------------------------------------
    def setup(self) -> None:
        """Initial server state: the global model starts from the seeded initialisation."""
        self.server["global"] = self.engine.get_params()

    def broadcast(self, client: "Client") -> Params:
        return select(self.server["global"], self.shared)

    def aggregate(self, updates: list[Update]) -> None:
        self.server["global"] = {**self.server["global"], **weighted_average(updates)}

    # -- client ---------------------------------------------------------------------
    # A method writes ONE of the two: the other is derived from it here.
    def local_update(self, client: "Client", payload: Params) -> Update:
        """One client's local update: its training from `payload`, returning its upload."""
        if type(self).local_updates is Method.local_updates:
            raise NotImplementedError(f"{self.name} has no local update (write local_update or local_updates)")
        return self.local_updates([client], [payload])[0]

    def local_updates(self, clients: list["Client"], payloads: list[Params]) -> list[Update]:
        """The local updates of `clients` (the round's sampled clients, or one), training through
        `engine.fit_many`; derived here, client by client, for a method that writes `local_update`."""
        return [self.local_update(c, p) for c, p in zip(clients, payloads)]

    # -- evaluation -------------------------------------------------------------------
    def global_params(self) -> Params | None:
        return self.server.get("global") if self.has_global else None

    def personal_params(self, client: "Client") -> Params | None:
        return None

    def report(self) -> dict[str, Any]:
        """Method-specific results for metrics.json's `method` entry (FedGCR's clustering accuracy)."""
        return {}

    def personalize_unseen(self, client: "Client") -> Params | None:
        """The personalized model of a client that never took part in training: it receives
        the broadcast, runs the method's own local update on its train split once, and the
        method's personal model is read off (new-client protocol of FedCRC's Table II)."""
        if not self.has_personal:
            return None
        self.local_update(client, self.broadcast(client))
        return self.personal_params(client)
