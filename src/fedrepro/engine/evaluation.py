"""Per-round evaluation and the untrained-client rule.

Owns how the federation's clients are scored at an evaluated round: the global model on every
client's own test (and validation) split in one pooled pass, each client's personalized model
on its own splits, and how a client that has not trained yet is scored (`evaluation.untrained`:
personalize, initial or exclude; `scored_by`). Personalized models are computed on batch
streams of their own (per purpose, round and client: training.Streams.personal), so evaluating
never changes training. What it keeps across a cell's evaluations is its own (`Scoring`). Every
function takes the cell (engine.py's `Engine`).

With the lever `batched_eval` (`training.levers`) the personalized models, computed client after
client as without it, are scored together: their parameters stacked along a new leading dimension
and every client's split, padded to the longest, run through one `torch.func.vmap` of
`functional_call` per chunk (`personal_scores_batched`), instead of one forward per client and
chunk and a host read per client. Where the model's eval forward cannot be vmapped (`batched_blocker`)
the clients are scored one by one, as without the lever.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..federation import Client
from ..io import derive_seed
from ..metrics import accuracy, macro_f1
from .training import set_params

Params = dict[str, torch.Tensor]

# How a client that has not trained yet is scored (config `evaluation.untrained`):
#   personalize  the method's new-client personalization (`Method.personalize_unseen`: one local
#                update from the broadcast, then its personal model), as for held-out clients;
#   initial      the common seeded initial model (PFLlib's clients before their first round);
#   exclude      left out of every aggregate (its scores are None in metrics.json).
# The rule applies to every method alike: the personal column of a method with personalized
# models, and (exclude only) the global column, so every row is computed on the same clients.
UNTRAINED_RULES = ("personalize", "initial", "exclude")

NO_SCORE = (math.nan, math.nan)  # accuracy and F1 of a client left out (excluded by the untrained rule)

#: Input elements of one vmapped forward of `batched_eval` (64 MiB of float32): the 20 clients of
#: Fashion-MNIST at eval_batch_size 1024 take one; larger inputs split the clients over several
#: forwards, since the activations run to tens of times the input.
BATCHED_ELEMENTS = 2**24


class Padded(NamedTuple):
    """One split of every client, padded with zeros to the longest: the inputs (clients, longest,
    ...) on the device, each client's number of samples, and each client's labels on the host."""

    x: torch.Tensor
    lengths: list[int]
    y: list[np.ndarray]


class Scoring:
    """What evaluation keeps across a cell's evaluations: every split's inputs of all `clients`
    concatenated once (`pooled`), and for the lever `batched_eval` padded once (`padded`) and
    whether the model's eval forward can be vmapped (`blocker`); the seconds spent making and
    scoring personalized models (`personal_seconds`: metrics.json's resources)."""

    def __init__(self, clients: list[Client]):
        self.clients = clients
        self.inputs: dict[str, torch.Tensor] = {}
        self.padded_splits: dict[str, Padded] = {}
        self.blocker: str | None = None
        self.blocker_checked = False
        self.personal_seconds = 0.0

    def pooled(self, split: str) -> torch.Tensor:
        """All clients' inputs of one split in client order, concatenated once and cached:
        the global model is scored on every client in a single batched pass."""
        if split not in self.inputs:
            self.inputs[split] = torch.cat([getattr(c, split).x for c in self.clients])
        return self.inputs[split]

    def padded(self, split: str) -> Padded:
        """All clients' inputs of one split stacked in client order, each padded to the longest,
        with the lengths and the labels on the host, made once and cached: every personalized
        model is scored in one vmapped pass (`personal_scores_batched`)."""
        if split not in self.padded_splits:
            data = [getattr(c, split) for c in self.clients]
            lengths = [len(d) for d in data]
            x = data[0].x.new_zeros((len(data), max(lengths)) + tuple(data[0].x.shape[1:]))
            for i, d in enumerate(data):
                x[i, : len(d)] = d.x
            self.padded_splits[split] = Padded(x, lengths, [d.y.cpu().numpy() for d in data])
        return self.padded_splits[split]


def scores(y: torch.Tensor | np.ndarray, pred: np.ndarray) -> tuple[float, float]:
    """Accuracy and macro-F1 of predictions `pred` of labels `y` (on the device or the host)."""
    yt = y.cpu().numpy() if isinstance(y, torch.Tensor) else y
    return accuracy(yt, pred), macro_f1(yt, pred)


def load_for_eval(model: nn.Module, params: Params) -> None:
    """Copy `params` into the model object (names not given keep theirs) and switch it to eval
    mode: how scoring a model leaves the model object."""
    set_params(model, params)
    model.eval()


@torch.no_grad()
def predict(engine, params: Params, x: torch.Tensor) -> np.ndarray:
    """The predicted classes of `x` under `params` (copied into the model object), in chunks."""
    load_for_eval(engine.model, params)
    bs = engine.training["eval_batch_size"]
    out = [engine.model(x[i : i + bs]).argmax(1) for i in range(0, len(x), bs)]
    return torch.cat(out).cpu().numpy() if out else np.zeros(0, dtype=np.int64)


def vmapped_predictions(model: nn.Module, stacked: Params, x: torch.Tensor) -> torch.Tensor:
    """The predicted classes (clients, samples) of `x` (clients, samples, ...) under each client's
    parameters (`stacked`: along the first dimension; names not given are the model object's, shared
    by all): one vmapped forward of the model in its current mode."""
    from torch.func import functional_call, vmap

    return vmap(lambda params, xc: functional_call(model, params, (xc,)).argmax(1))(stacked, x)


@torch.no_grad()
def batched_blocker(model: nn.Module, sample: torch.Tensor) -> str | None:
    """Why the clients' personalized models cannot be scored by one vmapped eval forward of
    `model` (put in eval mode) on inputs like `sample` (one sample with its batch dimension);
    None where they can. Tried once on two copies of the model's own parameters: a forward with
    data-dependent Python control flow fails under vmap, and one that writes its buffers would
    write only the stacked copies (the model object's would stay as they are). The model object's
    mode is left as it was."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None:
            return (f"BatchNorm without running statistics ({name}) normalises by each chunk's own statistics, "
                    "which the padding would change")
    state = model.state_dict()
    stacked = {n: torch.stack([v, v]) for n, v in state.items() if not n.startswith(model.frozen_prefixes)}
    training = model.training
    model.eval()
    try:
        vmapped_predictions(model, stacked, sample.expand(2, *sample.shape))
    except (RuntimeError, NotImplementedError) as e:
        return f"its eval forward fails under torch.func.vmap ({type(e).__name__}: {str(e).splitlines()[0]})"
    finally:
        model.train(training)
    written = [n for n, v in stacked.items() if not torch.equal(v[0], state[n])]
    return f"its eval forward writes {written[0]} in place" if written else None


def batched(engine) -> bool:
    """Whether the personalized models are scored in one vmapped pass: the lever `batched_eval`
    is on and the model allows it (else the reason is said once on stderr)."""
    if "batched_eval" not in (engine.training.get("levers") or ()):
        return False
    scoring = engine.scoring
    if not scoring.blocker_checked:
        sample = next((c.test.x[:1] for c in engine.clients if len(c.test)), None)
        scoring.blocker = None if sample is None else batched_blocker(engine.model, sample)
        scoring.blocker_checked = True
        if scoring.blocker is not None:
            print(f"[fedrepro] training.levers batched_eval: {scoring.blocker}; scoring the personalized models "
                  "client by client", file=sys.stderr)
    return scoring.blocker is None


@torch.no_grad()
def probs(engine, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The softmax outputs on `x` under `params`, in chunks."""
    load_for_eval(engine.model, params)
    bs = engine.training["eval_batch_size"]
    return torch.cat([F.softmax(engine.model(x[i : i + bs]), 1) for i in range(0, len(x), bs)])


def has_trained(engine, client: Client) -> bool:
    """Whether `client` has taken part in a round up to the current one."""
    rounds = engine.trained_in.get(client.id, [])
    return bool(rounds) and rounds[0] <= engine.round


def scored_by(engine, client: Client) -> str:
    """How `client` is scored now: 'trained', or for a client that has not trained yet the
    untrained rule ('personalize', 'initial', 'excluded'; 'global' for a method whose
    only model is the global one, which scores every client)."""
    if has_trained(engine, client):
        return "trained"
    if engine.untrained_rule == "exclude":
        return "excluded"
    return engine.untrained_rule if engine.method.has_personal else "global"


def evaluate(engine, personal: bool = True) -> dict[str, Any]:
    """Per-client accuracy and macro-F1 of the global and personalized models on each
    client's own test split (and validation split, where there is one). Clients that have
    not trained yet are scored by the untrained rule (`scored_by`); excluded ones get NaN.
    `personal=False` (a round `training.personal_eval_every` skips): the personalized
    column is NaN for every client, and no personalized model is computed."""
    clients = engine.clients
    splits = ["test"] + (["val"] if any(len(c.val) for c in clients) else [])
    record: dict[str, Any] = {"round": engine.round, "scored_by": [scored_by(engine, c) for c in clients]}
    keep = [how != "excluded" for how in record["scored_by"]]
    method = engine.method
    global_params = method.global_params() if method.has_global else None
    for split in splits:
        if global_params is not None:
            pred = predict(engine, global_params, engine.scoring.pooled(split))
            bounds = np.cumsum([0] + [len(getattr(c, split)) for c in clients])
            got = [scores(getattr(c, split).y, pred[a:b]) if k else NO_SCORE
                   for c, a, b, k in zip(clients, bounds[:-1], bounds[1:], keep)]
            record[f"{split}/global"] = {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}
    if method.has_personal and not personal:
        for split in splits:
            record[f"{split}/personal"] = {"acc": [math.nan] * len(clients), "f1": [math.nan] * len(clients)}
    elif method.has_personal:
        t0 = time.perf_counter()
        per = (personal_scores_batched if batched(engine) else personal_scores)(engine, record["scored_by"], splits)
        for split in splits:
            record[f"{split}/personal"] = {"acc": [s[0] for s in per[split]], "f1": [s[1] for s in per[split]]}
        engine.scoring.personal_seconds += time.perf_counter() - t0
    return record


def personal_scores(engine, hows: list[str], splits: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Each client's (accuracy, F1) on each split under its personalized model (`hows`: how each
    client is scored, `scored_by`), client after client."""
    per: dict[str, list[tuple[float, float]]] = {s: [] for s in splits}
    for c, how in zip(engine.clients, hows):
        params = personal_model(engine, c, how)
        for split in splits:
            data = getattr(c, split)
            per[split].append(NO_SCORE if params is None else scores(data.y, predict(engine, params, data.x)))
    return per


def personal_scores_batched(engine, hows: list[str], splits: list[str]) -> dict[str, list[tuple[float, float]]]:
    """`personal_scores` in one vmapped pass per split (the lever `batched_eval`). The personalized
    models are made client after client as there, each copied into the model object as scoring it
    there would (so the next one starts from the same model object, and names a personal dict lacks
    are the model object's), and into its row of the stacked parameters; the frozen part
    (`SplitModel.frozen_prefixes`, in no personal model) is the model object's, shared by all.
    Each split is then scored in chunks of eval_batch_size samples of every client at once: the
    clients longest first, so the ones whose samples are not over yet are a prefix (no forward on a
    client's padding beyond its last chunk), split over several forwards where the inputs exceed
    `BATCHED_ELEMENTS`; the predictions stay on the device until one read per split."""
    model, device = engine.model, engine.device
    kept: list[int] = []  # the scored clients, in the rows of `stacked`
    stacked: Params = {}
    for i, (c, how) in enumerate(zip(engine.clients, hows)):
        params = personal_model(engine, c, how)
        if params is None:
            continue
        load_for_eval(model, params)
        state = model.state_dict()
        if not stacked:
            scored = sum(h != "excluded" for h in hows)
            stacked = {n: v.new_empty((scored,) + v.shape) for n, v in state.items() if not n.startswith(model.frozen_prefixes)}
        for n, t in stacked.items():
            t[len(kept)].copy_(state[n])
        kept.append(i)
    per: dict[str, list[tuple[float, float]]] = {s: [NO_SCORE] * len(hows) for s in splits}
    bs = engine.training["eval_batch_size"]
    with torch.no_grad():  # the personalized models above may train (new-client personalization)
        for split in splits:
            pad = engine.scoring.padded(split)
            order = sorted(range(len(kept)), key=lambda r: -pad.lengths[kept[r]])  # rows of `stacked`, longest first
            lengths = [pad.lengths[kept[r]] for r in order]
            # index tensors staged by their copies (non_blocking: no wait for the queued work)
            clients = torch.tensor([kept[r] for r in order]).to(device, non_blocking=True)
            rows = torch.tensor(order).to(device, non_blocking=True)
            params = {n: t[rows] for n, t in stacked.items()}
            longest = lengths[0] if lengths else 0
            pred = torch.zeros((len(order), longest), dtype=torch.long, device=device)
            per_forward = max(1, BATCHED_ELEMENTS // (bs * math.prod(pad.x.shape[2:])))  # clients in one forward
            for s in range(0, longest, bs):
                e = min(s + bs, longest)
                active = sum(1 for n in lengths if n > s)
                for a in range(0, active, per_forward):
                    b = min(active, a + per_forward)
                    pred[a:b, s:e] = vmapped_predictions(model, {n: t[a:b] for n, t in params.items()},
                                                         pad.x[:, s:e][clients[a:b]])
            host = pred.cpu().numpy()
            for rank, r in enumerate(order):
                i = kept[r]
                per[split][i] = scores(pad.y[i], host[rank, : pad.lengths[i]])
    return per


def personal_model(engine, client: Client, how: str) -> Params | None:
    """The personalized model that scores `client` (`how` = `scored_by(client)`); None if excluded."""
    if how == "trained":
        return personal(engine, client)
    if how == "initial":
        return engine.initial_params
    if how == "personalize":
        # The new-client personalization must leave no trace: the client's state is restored
        # and the batches come from a stream of their own, so training is unchanged.
        saved = copy.deepcopy(client.state)
        torch.manual_seed(derive_seed(engine.seed, "untrained-personalize", engine.round, client.id))
        try:
            return personal(engine, client, "untrained-batches")
        finally:
            client.state = saved
    return None


def personal(engine, client: Client, purpose: str = "eval-batches") -> Params:
    """A client's personalized model: the method's (`purpose` "eval-batches"), or its new-client
    personalization (`Method.personalize_unseen`). Fine-tuning draws its batches from a stream of
    its own per (purpose, round, client): independent of training and of evaluation order."""
    with engine.streams.personal(purpose):
        return engine.method.personal_params(client) if purpose == "eval-batches" else engine.method.personalize_unseen(client)
