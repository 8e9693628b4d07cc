"""Local training: the tools a method trains the one model object with.

Owns how a client's data becomes seeded mini-batches (`batches`: one stream per round,
client and call), the fresh optimizer of every fit, `fit` (one client's epochs on its split,
with frozen parts, a custom loss or a gradient hook), `fit_many` (the sampled clients' fits:
one vectorized computation in a vectorized round, else client after client through `fit`),
and the extra passes methods need (`forward_with`, `features`, `fit_head`, `finetune_head`).
Every function takes the cell's `Engine` (engine.py), whose model object, streams and
settings it uses; the Engine exposes them to the methods as its own methods.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from ..methods.base import Batch, ClientFit, FitResult, select
from ..models import SplitModel
from .data import Client, Split
from .optim import OPTIMIZERS
from .vectorized import compiled_model, fit_many as fit_many_vectorized, replays_cuda_graphs, vectorize_blocker

Params = dict[str, torch.Tensor]


def batches(engine, client: Client, *, epochs: int | None = None, batch_size: int | None = None,
            split: str = "train", max_steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) mini-batches of a client's split: index slices of the tensors already on
    the device, in a seeded order (one stream per round, client and call), augmented
    on the device. Methods with their own inner loops (pFedMe, Per-FedAvg, APFL) use
    this; `fit` is built on it."""
    t = engine.training
    epochs = t["local_epochs"] if epochs is None else epochs
    batch_size = batch_size or t["batch_size"]
    data: Split = getattr(client, split)
    n = len(data)
    g = engine.generator(engine._batch_purpose, engine.round, client.id, engine._stream)
    engine._stream += 1
    stop = n - n % batch_size if t["drop_last"] and n >= batch_size else n
    steps = 0
    for _ in range(epochs):
        # non_blocking: no host-device synchronisation between a client's steps (the order is a
        # fresh pageable CPU tensor, staged by the copy itself); a no-op on the CPU
        perm = torch.randperm(n, generator=g).to(engine.device, non_blocking=True)
        for start in range(0, stop, batch_size):
            if max_steps is not None and steps >= max_steps:
                return
            idx = perm[start : start + batch_size]
            x, y = data.x[idx], data.y[idx]
            yield (engine.augment(x, g) if engine.augment is not None else x), y
            steps += 1


def optimizer(engine, params: Iterable[torch.Tensor], lr: float | None = None) -> torch.optim.Optimizer:
    """A fresh optimizer of the configured kind over `params` at the round's learning rate."""
    cfg = engine.training["optimizer"]
    return OPTIMIZERS[cfg["name"]](list(params), engine.lr if lr is None else lr, cfg["momentum"], cfg["weight_decay"])


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
    opt = engine.optimizer(params, lr)
    model = engine.model
    model.train()
    # The compiled step replaces the standard forward; a custom loss reads features and logits,
    # and CUDA-graph replays of a partly frozen model were wrong on a GPU (vectorized.py).
    compiled = engine.compile and loss_fn is None and not (frozen and replays_cuda_graphs(engine.compile, engine.device))
    forward = compiled_forward(engine) if compiled else None
    total = torch.zeros((), device=engine.device)
    seen, steps = 0, 0
    try:
        for x, y in engine.batches(client, epochs=epochs, batch_size=batch_size, split=split, max_steps=max_steps):
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


def compiled_forward(engine) -> torch.nn.Module:
    """The model object under `torch.compile` (`training.compile`), built once per cell."""
    if engine._compiled is None:
        engine._compiled = compiled_model(engine.model, engine.compile, engine.device)
    return engine._compiled


def fit_many(engine, clients: list[Client], starts: list[Params], **options: Any) -> list[ClientFit]:
    """`fit` of each of `clients` from its own parameters `starts[i]` (names not given: the model
    object's), with the same `options` (`fit`'s) for all; each client's trained parameters and loss.

    In a vectorized round (`Engine.train_round` with `training.vectorize`) the fits run as one
    computation (engine/vectorized.py), each client at its own position in its batch streams, and
    the model object is left as it was; where that cannot be the same computation (a `loss_fn`)
    and in every other case they run client after client through `fit`, each ending with its
    result in the model object (the last client's stays there, as after `fit`)."""
    vectorizing = engine._vectorizing
    if vectorizing and vectorize_blocker(engine.model, options.get("loss_fn")) is None:
        options = {k: v for k, v in options.items() if k != "loss_fn"}  # None here
        return fit_many_vectorized(engine, clients, starts, engine._streams, **options)
    out = []
    for client, start in zip(clients, starts):
        if vectorizing:  # the client's position in its own streams of this round, as vectorized fits keep it
            engine._stream = engine._streams.get(client.id, 0)
        engine.set_params(start)
        result = engine.fit(client, **options)
        out.append(ClientFit(engine.get_params(), result.loss, result.steps))
        if vectorizing:
            engine._streams[client.id] = engine._stream
    return out


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
    engine.set_params({**params, **(select(engine.initial_params, ("head.",)) if fresh else {})})
    feats = engine.features(client.train.x)
    opt = torch.optim.SGD(engine.model.head.parameters(), lr=lr, momentum=momentum)
    engine.fit_head(feats, client.train.y, epochs=epochs, batch_size=batch_size, opt=opt,
                    g=engine.generator("finetune", engine.round, client.id))
    return engine.get_params(("head.",))


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
