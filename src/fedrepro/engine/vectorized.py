"""Throughput paths of local training: many clients' fits as one computation, and a
compiled training step.

Both are opt-in (`training.vectorize`, `training.compile`); the default is the engine's
sequential, eager `fit` (training.py), bit for bit as before. This module computes only: it
takes the model and what training.py draws for it, and never the engine's state.

Vectorized fits (`fit_many`). Personalized-FL models are small and train at batch 10-64,
so one client's step launches a few dozen tiny kernels and a GPU idles between them. Here
the sampled clients' parameters are stacked along a new leading dimension and every local
step of all of them is one `torch.func.vmap` of `functional_call` over (parameters, batch):
K clients cost about one client's kernel launches. It is the same computation as K
sequential `fit` calls, to floating-point tolerance:

* each client gets exactly the batches the sequential path draws (training.py draws them from
  the same seeded stream per round, client and call, augmentation included);
* clients with fewer steps (fewer samples) or a shorter last batch are padded: padded
  samples have loss weight 0, so a client's loss is its mean over its real samples, and a
  client whose steps are over receives zero gradients; its parameters are read off right
  after its last step (later optimizer updates of a finished client are discarded);
* the optimizer is the configured torch optimizer over the stacked tensors. SGD, Adam and
  AdamW act element-wise and every client is active on a prefix of the steps, so a client's
  update at step s equals its own optimizer's s-th update (Adam's step count included);
* a `before_step` hook sees a module-like view whose `named_parameters()` are the stacked
  parameters, so hooks that edit gradients by broadcasting a shared anchor (FedProx's and
  Ditto's proximal term, `methods._helpers.proximal_hook`) work unchanged.

Where it cannot be the same computation, the sequential path runs (`vectorize_blocker`):
a custom `loss_fn`, a model with dropout (random per sample) or BatchNorm running
statistics (buffers updated in place). A method opts in with its class attribute
`vectorized = True` (its `Method.local_updates` then run in one vectorized round, and
its `fit_many` calls here).

Compiled step (`compiled_model`). `torch.compile` of the model object (forward and, via
AOTAutograd, backward); on CUDA with mode "reduce-overhead" the step is replayed as a CUDA
graph. Used by `fit` (training.py) for the standard cross-entropy step only: with a custom
`loss_fn` (which reads features and logits separately) the eager model runs, and so does a
fit that freezes part of the model (FedRep's, FedBABU's phases) where the step is replayed as
CUDA graphs: on an H100 (torch 2.11, 2026-11-26) FedRep's compiled uploads differed from the
eager ones (a first-round loss of 1.91 against 1.68) while every fully trainable fit matched;
inductor and aot_eager without CUDA graphs match eager for both phases (tests/test_throughput.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..federation import Client, ClientFit

Params = dict[str, torch.Tensor]

# Modules whose training-mode forward is not a pure function of (parameters, batch).
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORM = (nn.modules.batchnorm._BatchNorm,)


def vectorize_blocker(model: nn.Module, loss_fn: Callable | None = None) -> str | None:
    """Why the clients' fits cannot be vectorized for `model` (None: they can)."""
    if loss_fn is not None:
        return "a custom loss_fn"
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUT) and m.p > 0:
            return f"dropout ({name}) draws different random masks per client"
        if isinstance(m, _NORM) and m.track_running_stats:
            return f"BatchNorm running statistics ({name}) are updated in place"
    return None


class _StackedView:
    """What a `before_step` hook sees in a vectorized fit: the stacked parameters under
    their names (leading dimension = client), like `model.named_parameters()`."""

    def __init__(self, stacked: Params):
        self._stacked = stacked

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._stacked.items())

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._stacked.values())


def fit_many(
    model: nn.Module,
    device: torch.device,
    clients: list[Client],
    starts: list[Params],
    draw: Callable[[Client], list[tuple[torch.Tensor, torch.Tensor]]],
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    *,
    trainable: Iterable[str] = ("",),
    split: str = "train",
    before_step: Callable[[Any], None] | None = None,
) -> list[ClientFit]:
    """`fit` (engine/training.py) for every client of `clients` from its own start (`starts[i]`, a
    full state dict), run as one vectorized computation on `model`'s structure. `draw(client)`: the
    batches the sequential fit would draw for the client (training.py owns the streams);
    `optimizer(params)`: the fit's fresh optimizer over the stacked trainable tensors."""
    from torch.func import functional_call, vmap

    trainable = tuple(trainable)
    k = len(clients)
    names = [n for n, _ in model.named_parameters()]
    grad_names = [n for n, p in model.named_parameters() if n.startswith(trainable) and p.requires_grad]
    buffer_names = [n for n, _ in model.named_buffers()]
    state = model.state_dict()
    stacked: Params = {}
    for n in names + buffer_names:
        t = torch.stack([s[n] if n in s else state[n] for s in starts]).detach().clone()
        stacked[n] = t.requires_grad_(n in grad_names)
    opt = optimizer([stacked[n] for n in grad_names])

    per_client = [draw(c) for c in clients]
    steps = [len(b) for b in per_client]
    total_steps = max(steps, default=0)
    sample = getattr(clients[0], split).x
    width = max((len(y) for b in per_client for _, y in b), default=0)

    def loss_of(params: Params, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x,))
        return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum().clamp(min=1)

    batched_loss = vmap(loss_of)
    results: list[ClientFit | None] = [None] * k
    finished: list[torch.Tensor | None] = [None] * k  # loss sums, read back once after the loop
    total = torch.zeros(k, device=device)
    seen = [0] * k
    model.train()

    def finish(i: int) -> None:
        finished[i] = total[i].clone()
        results[i] = ClientFit({n: stacked[n][i].detach().clone() for n in state}, 0.0, steps[i])

    for i in range(k):
        if steps[i] == 0:
            finish(i)
    # The padded batches of `chunk` steps at a time, staged outside the step loop (a stacked
    # copy per client and chunk), within a bounded memory budget.
    per_step = k * max(width, 1) * max(sample[0].numel() if len(sample) else 1, 1)
    chunk = max(1, _STAGING_ELEMENTS // per_step)
    for c0 in range(0, total_steps, chunk):
        c1 = min(total_steps, c0 + chunk)
        x, y, w = _stage(per_client, c0, c1, width, sample, device)
        for s in range(c0, c1):
            losses = batched_loss(stacked, x[s - c0], y[s - c0], w[s - c0])
            opt.zero_grad(set_to_none=True)
            losses.sum().backward()  # client i's loss depends on its own slice only: per-client gradients
            if before_step is not None:
                before_step(_StackedView({n: stacked[n] for n in names}))
            opt.step()
            total += losses.detach() * w[s - c0].sum(1)
            for i in range(k):
                if steps[i] == s + 1:
                    seen[i] = sum(len(yb) for _, yb in per_client[i])
                    finish(i)
    for i, r in enumerate(results):
        r.loss = float(finished[i]) / max(seen[i], 1)  # type: ignore[union-attr, arg-type]
    return results  # type: ignore[return-value]


# Elements of input staged for the padded batches at once (512 MiB of float32).
_STAGING_ELEMENTS = 2**27


def _stage(per_client: list[list[tuple[torch.Tensor, torch.Tensor]]], c0: int, c1: int, width: int,
           sample: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps c0..c1-1 of every client as zero-padded (steps, clients, width, ...) inputs,
    labels and loss weights (1 for a real sample, 0 for padding and finished clients)."""
    k = len(per_client)
    x = torch.zeros((c1 - c0, k, width) + tuple(sample.shape[1:]), dtype=sample.dtype, device=device)
    y = torch.zeros((c1 - c0, k, width), dtype=torch.long, device=device)
    w = torch.zeros((c1 - c0, k, width), dtype=sample.dtype, device=device)
    for i, batches in enumerate(per_client):
        part = batches[c0:c1]
        full = [j for j, (_, yb) in enumerate(part) if len(yb) == width]  # one stacked copy for all of them
        if full:
            at = torch.tensor(full, device=device)
            x[at, i] = torch.stack([part[j][0] for j in full])
            y[at, i] = torch.stack([part[j][1] for j in full])
            w[at, i] = 1
        for j, (xb, yb) in enumerate(part):  # the short last batch of each epoch
            if len(yb) < width:
                x[j, i, : len(yb)] = xb
                y[j, i, : len(yb)] = yb
                w[j, i, : len(yb)] = 1
    return x, y, w


def replays_cuda_graphs(setting: bool | str, device: torch.device) -> bool:
    """Whether `compiled_model(setting)` replays the step as CUDA graphs on `device`."""
    return device.type == "cuda" and (setting is True or setting in ("inductor", "cudagraphs"))


def compiled_model(model: nn.Module, setting: bool | str, device: torch.device) -> nn.Module:
    """`torch.compile(model)` for the `training.compile` setting: True = the inductor
    backend, mode "reduce-overhead" (CUDA graphs) on CUDA and the default mode on the CPU;
    a string names another torch.compile backend ("aot_eager", "cudagraphs", ...)."""
    if setting is True or setting == "inductor":
        mode = "reduce-overhead" if replays_cuda_graphs(setting, device) else None  # CUDA graphs on a GPU
        return torch.compile(model, mode=mode)
    return torch.compile(model, backend=str(setting))
