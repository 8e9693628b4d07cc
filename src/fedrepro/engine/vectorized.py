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
  after its last step, masked in by `torch.where` at the steps where some client ends (later
  optimizer updates of a finished client, by momentum or weight decay, are discarded);
* the optimizer is the configured torch optimizer over the stacked tensors. SGD, Adam and
  AdamW act element-wise and every client is active on a prefix of the steps, so a client's
  update at step s equals its own optimizer's s-th update (Adam's step count included);
* a `before_step` hook sees a module-like view whose `named_parameters()` are the stacked
  parameters, so hooks that edit gradients by broadcasting a shared anchor (FedProx's and
  Ditto's proximal term, `methods._helpers.proximal_hook`) work unchanged.

Levers (`training.levers`, issue 36): the launch limit of a GPU round. `resident_batches`:
every batch is one gather from all clients' data held once on the device (`ResidentBatches`),
the round's batch indices laid out on the host and sent at once, instead of a staged copy per
client (`StagedBatches`, the default). `fused_step`: torch's fused optimizer step over the
stacked tensors. `cuda_graph`: the step over static buffers, captured once per fit as a CUDA
graph and replayed, and the read-off likewise (`_replayed_steps`; on a CPU they run eagerly).
`device_losses`: the fits' losses stay device tensors; the loop reads a round's losses at once
(loop._settled). Each equals the default path: the gather and the device-side loss division
bit for bit, the fused step to floating-point tolerance (tests/test_levers.py; on a GPU
tests/test_cuda.py).

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

import contextlib
import sys
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


class StagedBatches:
    """The batches every client's sequential fit draws (lists of (x, y) on the device), staged as
    zero-padded (clients, width, ...) blocks step after step, `chunk` steps copied at a time: the
    default batch source of a vectorized fit."""

    def __init__(self, per_client: list[list[tuple[torch.Tensor, torch.Tensor]]], sample: torch.Tensor, device: torch.device):
        self.per_client, self.sample, self.device = per_client, sample, device
        self.steps = [len(b) for b in per_client]
        self.seen = [sum(len(y) for _, y in b) for b in per_client]
        self.width = max((len(y) for b in per_client for _, y in b), default=0)

    def blocks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x, y, w) of every step: inputs, labels, loss weights (0 for padding and finished clients)."""
        # The padded batches of `chunk` steps at a time, staged outside the step loop (a stacked
        # copy per client and chunk), within a bounded memory budget.
        per_step = len(self.per_client) * max(self.width, 1) * max(self.sample[0].numel() if len(self.sample) else 1, 1)
        chunk = max(1, _STAGING_ELEMENTS // per_step)
        for c0 in range(0, max(self.steps, default=0), chunk):
            c1 = min(max(self.steps), c0 + chunk)
            x, y, w = _stage(self.per_client, c0, c1, self.width, self.sample, self.device)
            for j in range(c1 - c0):
                yield x[j], y[j], w[j]


class ResidentBatches:
    """Lever `resident_batches`: every client's batches as rows of one resident tensor. `x`, `y`
    hold all clients' split data concatenated on the device (training.ResidentSplits); `rows[s, i]`
    are the rows of client i's batch at step s (padding: row 0 at loss weight 0). The whole fit's
    rows are laid out on the host from the order the sequential fit draws (training.batch_rows) and
    sent in one transfer, so a step is one gather instead of a staged copy per client."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows_per_client: list[list[torch.Tensor]], device: torch.device):
        self.x, self.y = x, y
        self.steps = [len(r) for r in rows_per_client]
        self.seen = [sum(len(r) for r in rs) for rs in rows_per_client]
        width = max((len(r) for rs in rows_per_client for r in rs), default=0)
        total_steps = max(self.steps, default=0)
        self.rows = to_device(_padded(rows_per_client, total_steps, width, (), torch.long, torch.device("cpu")), device)
        self.weights = _weights(rows_per_client, total_steps, width, x.dtype, device)

    def blocks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for s in range(len(self.rows)):
            yield self.x[self.rows[s]], self.y[self.rows[s]], self.weights[s]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (host) on `device` without the host waiting: a pinned copy is asynchronous, a pageable one
    synchronises the stream (no-op on the CPU)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def fit_many(
    model: nn.Module,
    device: torch.device,
    clients: list[Client],
    starts: list[Params],
    plan: StagedBatches | ResidentBatches,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    *,
    trainable: Iterable[str] = ("",),
    before_step: Callable[[Any], None] | None = None,
    levers: Iterable[str] = (),
) -> list[ClientFit]:
    """`fit` (engine/training.py) for every client of `clients` from its own start (`starts[i]`, a
    full state dict), run as one vectorized computation on `model`'s structure. `plan`: the batches
    the sequential fits would draw (training.py owns the streams); `optimizer(params)`: the fit's
    fresh optimizer over the stacked trainable tensors (its fused step with `fused_step`).
    `levers` (training.levers): `cuda_graph` replays the step as a CUDA graph (`_replayed_steps`);
    `device_losses` returns the losses as device tensors (loop.train_round reads a round's losses at once)."""
    from torch.func import functional_call, vmap

    levers = frozenset(levers)
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
    steps = plan.steps

    def loss_of(params: Params, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x,))
        return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum().clamp(min=1)

    batched_loss = vmap(loss_of)
    total = torch.zeros(k, device=device)  # each client's summed sample losses
    model.train()
    # What each client ends with: its parameters and loss sum right after its last step (a
    # finished client gets zero gradients, but momentum or weight decay would still move it).
    final: Params = {n: stacked[n].detach().clone() for n in state}
    final_total = total.clone()
    ends = to_device(_ends(steps), device)  # (step, client): True at each client's last step
    end_steps = {n - 1 for n in steps if n}

    def step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, zero: bool = True) -> None:
        losses = batched_loss(stacked, x, y, w)
        if zero:
            opt.zero_grad(set_to_none=True)
        losses.sum().backward()  # client i's loss depends on its own slice only: per-client gradients
        if before_step is not None:
            before_step(_StackedView({n: stacked[n] for n in names}))
        opt.step()
        total.add_(losses.detach() * w.sum(1))

    def read_off(end: torch.Tensor) -> None:
        """The clients finishing at this step (mask `end`) masked into `final`: no host-side index."""
        for n, t in final.items():
            t.copy_(torch.where(end.view((k,) + (1,) * (t.dim() - 1)), stacked[n].detach(), t))
        final_total.copy_(torch.where(end, total, final_total))

    if "cuda_graph" in levers:
        _replayed_steps(plan, ends, end_steps, step, read_off, opt, device)
    else:
        for s, (x, y, w) in enumerate(plan.blocks()):
            step(x, y, w)
            if s in end_steps:
                read_off(ends[s])
    if "device_losses" in levers:  # float64 on the device: the same rounding as the host's float division
        losses = final_total.double() / to_device(torch.tensor([max(n, 1) for n in plan.seen], dtype=torch.float64), device)
        loss_of_client = list(losses.unbind())
    else:
        loss_of_client = [total_i / max(n, 1) for total_i, n in zip(final_total.tolist(), plan.seen)]
    return [ClientFit({n: final[n][i].clone() for n in state}, loss_of_client[i], steps[i]) for i in range(k)]


def _ends(steps: list[int]) -> torch.Tensor:
    """(total steps, clients) mask: True at each client's last step."""
    ends = torch.zeros((max(steps, default=0), len(steps)), dtype=torch.bool)
    for i, n in enumerate(steps):
        if n:
            ends[n - 1, i] = True
    return ends


# Eager steps before a capture: they create the optimizer's state (momentum, Adam's moments) that
# the captured step then updates in place, and warm the kernels up on a side stream (torch.cuda.graphs).
_WARMUP_STEPS = 3


def _replayed_steps(plan: ResidentBatches, ends: torch.Tensor, end_steps: set[int], step: Callable[..., None],
                    read_off: Callable[[torch.Tensor], None], opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Lever `cuda_graph`: the step is one fixed body over static buffers (the step's batch rows and
    loss weights, copied in before it runs), and so is the read-off of the clients finishing at a
    step (its mask). On CUDA each is captured once per fit after the warm-up steps and replayed: one
    launch a step instead of every kernel's, the read-off only at the steps where a client ends.
    Elsewhere the same bodies run eagerly, so the CPU checks everything but the capture."""
    rows, weights, end = plan.rows[0].clone(), plan.weights[0].clone(), ends[0].clone()

    def load(s: int) -> None:
        rows.copy_(plan.rows[s])
        weights.copy_(plan.weights[s])
        end.copy_(ends[s])

    def body(zero: bool) -> None:
        step(plan.x[rows], plan.y[rows], weights, zero=zero)

    total_steps = len(plan.rows)
    capture = device.type == "cuda" and total_steps > _WARMUP_STEPS
    warmup = _WARMUP_STEPS if capture else total_steps
    side = torch.cuda.Stream(device) if capture else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for s in range(warmup):
            load(s)
            body(zero=True)
            if s in end_steps:
                read_off(end)
    if not capture:
        return
    torch.cuda.current_stream(device).wait_stream(side)
    stepped, read = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the captured backward writes fresh gradients into the graph's pool
    try:
        with torch.cuda.graph(stepped):
            body(zero=False)
        with torch.cuda.graph(read):
            read_off(end)
    except RuntimeError as e:  # a capture records and runs nothing: the fit goes on eagerly from here
        _say_once(f"training.levers cuda_graph: the step could not be captured ({str(e).splitlines()[0]}); "
                  "running it eagerly")
        stepped = read = None
    for s in range(warmup, total_steps):
        load(s)
        if stepped is None:
            body(zero=True)
        else:
            stepped.replay()
        if s in end_steps and read is None:
            read_off(end)
        elif s in end_steps:
            read.replay()


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"[fedrepro] {message}", file=sys.stderr)


# Elements of input staged for the padded batches at once (512 MiB of float32).
_STAGING_ELEMENTS = 2**27


def _stage(per_client: list[list[tuple[torch.Tensor, torch.Tensor]]], c0: int, c1: int, width: int,
           sample: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps c0..c1-1 of every client as zero-padded (steps, clients, width, ...) inputs,
    labels and loss weights (1 for a real sample, 0 for padding and finished clients)."""
    xs = [[xb for xb, _ in batches[c0:c1]] for batches in per_client]
    ys = [[yb for _, yb in batches[c0:c1]] for batches in per_client]
    return (_padded(xs, c1 - c0, width, tuple(sample.shape[1:]), sample.dtype, device),
            _padded(ys, c1 - c0, width, (), torch.long, device), _weights(ys, c1 - c0, width, sample.dtype, device))


def _padded(parts: list[list[torch.Tensor]], steps: int, width: int, trailing: tuple, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """`parts[i][s]` (client i's batch at step s: up to `width` rows of shape `trailing`) as one
    zero-padded (steps, clients, width, *trailing) tensor: a client's full batches in one stacked
    copy, its short ones (the last of each epoch) one by one."""
    out = torch.zeros((steps, len(parts), width) + trailing, dtype=dtype, device=device)
    for i, batches in enumerate(parts):
        full = [s for s, b in enumerate(batches) if len(b) == width]
        if full:
            out[torch.tensor(full, device=device), i] = torch.stack([batches[s] for s in full])
        for s, b in enumerate(batches):
            if len(b) < width:
                out[s, i, : len(b)] = b
    return out


def _weights(parts: list[list[torch.Tensor]], steps: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The loss weights of `_padded(parts, ...)`: 1 for a real row, 0 for padding and finished clients."""
    lengths = torch.zeros((steps, len(parts)), dtype=torch.long)
    for i, batches in enumerate(parts):
        lengths[: len(batches), i] = torch.tensor([len(b) for b in batches], dtype=torch.long)
    return to_device((torch.arange(width) < lengths[..., None]).to(dtype), device)


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
