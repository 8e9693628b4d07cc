"""Local training: the tools a method trains the one model object with, and the state they keep.

Owns the cell's seeded batch streams (`Streams`: which generator every `batches` call draws its
order and augmentation from), parameters in and out of the model object (`get_params`,
`set_params`), the fresh optimizer of every fit, `fit` (one client's epochs on its split, with
frozen parts, a custom loss or a gradient hook), `fit_many` (the sampled clients' fits: one
vectorized computation in a vectorized round, else client after client through `fit`), the
compiled step (`CompiledStep`), and the extra passes methods need (`forward_with`, `features`,
`fit_head`, `finetune_head`). The functions take the cell (engine.py's `Engine`) and read its
model object, settings and round; they call each other here, never back into the façade, which
hands them to the methods as its verbs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..federation import Batch, Client, ClientFit, FitResult, Split, select
from ..io import derive_seed
from ..models import SplitModel
from . import vectorized
from .vectorized import compiled_model, replays_cuda_graphs, vectorize_blocker
from .optim import OPTIMIZERS, lever_options, round_lr

Params = dict[str, torch.Tensor]


class Streams:
    """The cell's batch streams. Every batch order (and its augmentation) is drawn from a generator
    seeded by (seed, purpose, round, client, position) (`io.derive_seed`), never from one running
    stream, so a run resumed from a checkpoint draws what an uninterrupted one draws.

    `purpose` is "batches" in training, another one while personalized models are computed
    (`personal`: evaluation never changes training); `position` counts the current client's
    `batches` calls (each client's local update starts at 0); in a vectorized round each client keeps
    its own position across the round's fits (`positions`, None outside one)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.purpose = "batches"
        self.position = 0
        self.positions: dict[int, int] | None = None

    def generator(self, *keys: int | str) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, *keys))

    def next(self, round: int, client_id: int) -> torch.Generator:
        """The generator of the next `batches` call of `client_id` in `round`."""
        g = self.generator(self.purpose, round, client_id, self.position)
        self.position += 1
        return g

    def start_client(self) -> None:
        """A client's local update starts at the beginning of its streams (sequential rounds)."""
        self.position = 0

    @property
    def vectorizing(self) -> bool:
        """Inside a vectorized round's local updates (loop.train_round)."""
        return self.positions is not None

    @contextmanager
    def vectorized_round(self) -> Iterator[None]:
        self.positions = {}
        try:
            yield
        finally:
            self.positions = None

    def resume(self, client_id: int) -> None:
        """In a vectorized round: continue `client_id`'s streams where its last fit of the round left them."""
        if self.positions is not None:
            self.position = self.positions.get(client_id, 0)

    def suspend(self, client_id: int) -> None:
        if self.positions is not None:
            self.positions[client_id] = self.position

    @contextmanager
    def personal(self, purpose: str) -> Iterator[None]:
        """Streams of their own per (purpose, round, client) while a personalized model is computed."""
        self.purpose, self.position = purpose, 0
        try:
            yield
        finally:
            self.purpose = "batches"


class CompiledStep:
    """The model object under `torch.compile` (`training.compile`), built once per cell when a fit
    first uses it (`module`: None until then)."""

    def __init__(self, setting: bool | str):
        self.setting = setting
        self.module: torch.nn.Module | None = None

    def forward(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if self.module is None:
            self.module = compiled_model(model, self.setting, device)
        return self.module


def get_params(model: SplitModel, prefixes: Iterable[str] = ("",)) -> Params:
    """A copy of the model's parameters and buffers whose names start with `prefixes`; a frozen
    part (`SplitModel.frozen_prefixes`, a pretrained backbone) is never among them."""
    frozen = model.frozen_prefixes
    return {k: v.detach().clone() for k, v in select(model.state_dict(), prefixes).items()
            if not (frozen and k.startswith(frozen))}


def set_params(model: torch.nn.Module, params: Params) -> None:
    """Copy `params` into the one model object (names not given are left as they are)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in params.items():
            state[k].copy_(v)


def batches(engine, client: Client, *, epochs: int | None = None, batch_size: int | None = None,
            split: str = "train", max_steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) mini-batches of a client's split: index slices of the tensors already on
    the device, in a seeded order (one stream per round, client and call), augmented
    on the device. Methods with their own inner loops (pFedMe, Per-FedAvg, APFL) use
    this; `fit` is built on it."""
    data: Split = getattr(client, split)
    g = engine.streams.next(engine.round, client.id)
    on_device = None
    for perm, start, stop in _order(engine, len(data), g, epochs, batch_size, max_steps):
        if on_device is None or on_device[0] is not perm:
            # non_blocking: no host-device synchronisation between a client's steps (the order is a
            # fresh pageable CPU tensor, staged by the copy itself); a no-op on the CPU
            on_device = perm, perm.to(engine.device, non_blocking=True)
        idx = on_device[1][start:stop]
        x, y = data.x[idx], data.y[idx]
        yield (engine.augment(x, g) if engine.augment is not None else x), y


def batch_rows(engine, client: Client, *, epochs: int | None = None, batch_size: int | None = None,
               split: str = "train", max_steps: int | None = None) -> list[torch.Tensor]:
    """The indices (on the host) of the batches `batches` yields, without the data: drawn from the
    same stream, so equal to its batches' wherever no augmentation draws from that stream too."""
    g = engine.streams.next(engine.round, client.id)
    return [perm[start:stop] for perm, start, stop in _order(engine, len(getattr(client, split)), g, epochs, batch_size, max_steps)]


def _order(engine, n: int, g: torch.Generator, epochs: int | None, batch_size: int | None,
           max_steps: int | None) -> Iterator[tuple[torch.Tensor, int, int]]:
    """(epoch order, start, stop) of every mini-batch of a fit over `n` samples: a fresh permutation
    from `g` per epoch (drawn lazily, so an augmentation between batches draws from `g` in between)."""
    t = engine.training
    epochs = t["local_epochs"] if epochs is None else epochs
    batch_size = batch_size or t["batch_size"]
    stop = n - n % batch_size if t["drop_last"] and n >= batch_size else n
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, stop, batch_size):
            if max_steps is not None and steps >= max_steps:
                return
            yield perm, start, start + batch_size
            steps += 1


class ResidentSplits:
    """Lever `resident_batches`: every client's split concatenated once on the device (inputs,
    labels, and each client's first row), built when a vectorized fit first asks for the split."""

    def __init__(self, clients: list[Client]):
        self.clients = clients
        self.splits: dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, int]]] = {}

    def of(self, split: str) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
        if split not in self.splits:
            parts = [getattr(c, split) for c in self.clients]
            offsets = np.cumsum([0] + [len(p) for p in parts])
            self.splits[split] = (torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts]),
                                  {c.id: int(o) for c, o in zip(self.clients, offsets)})
        return self.splits[split]


def optimizer(engine, params: Iterable[torch.Tensor], lr: float | None = None,
              levers: frozenset[str] = frozenset()) -> torch.optim.Optimizer:
    """A fresh optimizer of the configured kind over `params` at the round's learning rate;
    `levers`: those of a vectorized round (its fused, capturable step: optim.lever_options)."""
    cfg = engine.training["optimizer"]
    lr = round_lr(engine.training, engine.round) if lr is None else lr
    options = lever_options(cfg["name"], levers, engine.device)
    return OPTIMIZERS[cfg["name"]](list(params), lr, cfg["momentum"], cfg["weight_decay"], **options)


def fit(engine, client: Client, *, epochs: int | None = None, trainable: Iterable[str] = ("",), lr: float | None = None,
        batch_size: int | None = None, split: str = "train", max_steps: int | None = None,
        loss_fn: Callable[[Batch], torch.Tensor] | None = None,
        before_step: Callable[[SplitModel], None] | None = None) -> FitResult:
    """Train the model object in place on one client's split with a fresh optimizer.

    Only parameters whose names start with `trainable` are updated (the rest are
    frozen: FedRep, FedBABU, ...). `loss_fn(batch)` replaces cross-entropy (e.g. to add
    a proximal or contrastive term); `before_step(model)` may edit gradients (SCAFFOLD,
    FedProx); `max_steps` stops early (Per-FedAvg's one-step adaptation).
    """
    trainable = tuple(trainable)
    named = list(engine.model.named_parameters())
    params = [p for name, p in named if name.startswith(trainable) and p.requires_grad]
    frozen = [p for name, p in named if not name.startswith(trainable) and p.requires_grad]
    for p in frozen:  # no gradients for the frozen part: cheaper, and the optimizer never sees it
        p.requires_grad_(False)
    opt = optimizer(engine, params, lr)
    model = engine.model
    model.train()
    # The compiled step replaces the standard forward; a custom loss reads features and logits,
    # and CUDA-graph replays of a partly frozen model were wrong on a GPU (vectorized.py).
    setting = engine.compiled.setting
    compiled = setting and loss_fn is None and not (frozen and replays_cuda_graphs(setting, engine.device))
    forward = engine.compiled.forward(model, engine.device) if compiled else None
    total = torch.zeros((), device=engine.device)
    seen, steps = 0, 0
    try:
        for x, y in batches(engine, client, epochs=epochs, batch_size=batch_size, split=split, max_steps=max_steps):
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


def fit_many(engine, clients: list[Client], starts: list[Params], **options: Any) -> list[ClientFit]:
    """`fit` of each of `clients` from its own parameters `starts[i]` (names not given: the model
    object's), with the same `options` (`fit`'s) for all; each client's trained parameters and loss.

    In a vectorized round (loop.train_round with `training.vectorize`) the fits run as one
    computation (engine/vectorized.py), each client at its own position in its batch streams, and
    the model object is left as it was; where that cannot be the same computation (a `loss_fn`)
    and in every other case they run client after client through `fit`, each ending with its
    result in the model object (the last client's stays there, as after `fit`)."""
    streams = engine.streams
    if streams.vectorizing and vectorize_blocker(engine.model, options.get("loss_fn")) is None:
        options = {k: v for k, v in options.items() if k != "loss_fn"}  # None here
        return _vectorized_fits(engine, clients, starts, **options)
    out = []
    for client, start in zip(clients, starts):
        streams.resume(client.id)  # in a vectorized round: its position in its own streams, as vectorized fits keep it
        set_params(engine.model, start)
        result = fit(engine, client, **options)
        out.append(ClientFit(get_params(engine.model), result.loss, result.steps))
        streams.suspend(client.id)
    return out


def _vectorized_fits(engine, clients: list[Client], starts: list[Params], *, epochs: int | None = None,
                     lr: float | None = None, batch_size: int | None = None, max_steps: int | None = None,
                     split: str = "train", **options: Any) -> list[ClientFit]:
    """`fit_many` as one vectorized computation (vectorized.fit_many), each client drawing the
    batches its sequential fit would draw, at its position in its streams of this round; with the
    lever `resident_batches` (the config allows it only without augmentation, which draws from the
    same stream between batches) only their indices, gathered from the resident data (`ResidentSplits`)."""
    levers = frozenset(engine.training.get("levers") or ())
    order = dict(epochs=epochs, batch_size=batch_size, split=split, max_steps=max_steps)

    def drawn(client: Client, draw: Callable) -> list:
        engine.streams.resume(client.id)
        out = list(draw(engine, client, **order))  # drawn now, at the client's position in its streams
        engine.streams.suspend(client.id)
        return out

    if "resident_batches" in levers:
        x, y, first = engine.resident.of(split)
        plan = vectorized.ResidentBatches(
            x, y, [[first[c.id] + r for r in drawn(c, batch_rows)] for c in clients], engine.device)
    else:
        plan = vectorized.StagedBatches([drawn(c, batches) for c in clients], getattr(clients[0], split).x, engine.device)
    return vectorized.fit_many(engine.model, engine.device, clients, starts, plan,
                               lambda params: optimizer(engine, params, lr, levers),
                               levers=levers, **options)


def forward_with(engine, params: Params, x: torch.Tensor, features: bool = False) -> torch.Tensor:
    """The model object's output (or representation) with `params` in place of its
    own, without copying them in: for methods that need a second model in the same
    step (APFL's mixture, MOON's global and previous representations). Gradients flow
    to `params` where they require them."""
    from torch.func import functional_call

    full = {**engine.model.state_dict(), **params}
    if features:
        return functional_call(engine.model.extractor, {k[len("extractor."):]: v for k, v in full.items() if k.startswith("extractor.")}, (x,))
    return functional_call(engine.model, full, (x,))


@torch.no_grad()
def features(engine, x: torch.Tensor) -> torch.Tensor:
    """Representations of `x` from the model object in eval mode, in chunks."""
    engine.model.eval()
    bs = engine.training["eval_batch_size"]
    return torch.cat([engine.model.extractor(x[i : i + bs]) for i in range(0, len(x), bs)]) if len(x) else x.new_zeros((0, engine.model.feature_dim))


def finetune_head(engine, params: Params, client: Client, *, epochs: int, lr: float, batch_size: int,
                  momentum: float = 0.0, fresh: bool = False) -> Params:
    """Fine-tune the head of `params` on the client's frozen train features; return the head.

    The personalization stage of any method: `fresh` starts from the seeded initial head
    (a new linear classifier on a frozen encoder, Calibre's protocol) instead of `params`'s.
    The features are computed once (extractor frozen, eval mode), so this costs one
    forward pass plus the head's own steps. Uses its own random stream, so evaluating
    never changes training.
    """
    set_params(engine.model, {**params, **(select(engine.initial_params, ("head.",)) if fresh else {})})
    feats = features(engine, client.train.x)
    opt = torch.optim.SGD(engine.model.head.parameters(), lr=lr, momentum=momentum)
    fit_head(engine, feats, client.train.y, epochs=epochs, batch_size=batch_size, opt=opt,
             g=engine.streams.generator("finetune", engine.round, client.id))
    return get_params(engine.model, ("head.",))


def fit_head(engine, z: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, opt: torch.optim.Optimizer,
             g: torch.Generator, loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             drop_last: bool = False) -> None:
    """Train the model's head in place on fixed representations `z` (computed once, the
    extractor frozen): index-sliced batches in the order drawn from `g`; `loss_fn(logits,
    z, y)` replaces cross-entropy (FedCRC's KL-guided global head)."""
    head = engine.model.head
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
