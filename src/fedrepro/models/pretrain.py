"""Pre-train a frozen-to-be ViT backbone once on a dataset's held-out proxy (FedGCR's CPU variant,
methods.md §5.9 (a)): where the ImageNet weights cannot be downloaded, a tiny timm ViT is trained
centrally on images the federation never sees (`shifted_domains`: the base images no domain
uses, in the domains' styles), then frozen inside `prompted_vit`.

The config asks for it with the model parameter `weights: proxy` and `datasets.<ds>.model.pretrain`
(epochs, samples, batch_size, lr, seed); fedrepro.config turns `proxy` into the content-addressed
checkpoint path `results/pretrained/<dataset>/<hash>.pt`, which the workflow's `pretrain_backbone`
rule writes with `fedrepro pretrain-backbone` (cached: same spec, same file; seeded: same bytes
of weights on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..io import atomic_path, derive_seed, short_hash
from ..registry import ConfigError, Param, resolve_params, show

PROXY_WEIGHTS = "proxy"  # the model parameter value that asks for a proxy-pretrained backbone
PRETRAINED_DIR = "results/pretrained"

PRETRAIN_PARAMS = {
    "epochs": Param(3, "passes over the proxy images", int, minimum=1, maximum=1000),
    "samples": Param(10_000, "at most this many proxy images", int, minimum=1),
    "batch_size": Param(128, "mini-batch size", int, minimum=1, maximum=65_536),
    "lr": Param(1e-3, "AdamW learning rate (weight decay 0.05, cosine decay to 0)", float, exclusive_minimum=0),
    "seed": Param(0, "seed of the initialisation, the proxy's styles and the batch order", int, minimum=0),
    "styles": Param(None, "the styles the proxy images are rendered in (shifted_domains' style names); null = the "
                          "dataset's own domains. A source unlike the clients' domains (e.g. [gray]) leaves the frozen "
                          "backbone a domain shift to bridge, as ImageNet's ViT faces on Digit-Five", list,
                    items=Param("gray", "a style", str)),
}
#: keys left out of the spec (and so of its hash) at their default, so that adding them kept every
#: existing backbone's path
OPTIONAL_KEYS = ("styles",)


def _shifted_proxy(root: Path, params: dict, limit: int, seed: int, styles: list[str] | None = None):
    from ..data.domains.shifted import proxy_images

    return proxy_images(root, params, limit, seed, styles)


#: dataset -> proxy(root, dataset params, limit, seed, styles) -> (x uint8 (n, C, H, W), y, num_classes)
PROXY_SOURCES: dict[str, Callable[..., tuple[np.ndarray, np.ndarray, int]]] = {"shifted_domains": _shifted_proxy}


def pretrain_spec(dataset: str, dataset_params: dict, model: dict, pretrain: dict | None, where: str) -> dict[str, Any]:
    """The resolved pretraining spec of a dataset's `prompted_vit` with `weights: proxy`, and its output path."""
    if dataset not in PROXY_SOURCES:
        raise ConfigError(f"config key '{where}.params.weights' has value '{PROXY_WEIGHTS}' for dataset {dataset!r}, which "
                          f"has no held-out proxy; allowed: datasets {sorted(PROXY_SOURCES)}, or weights 'timm' / 'none' / a path")
    settings = resolve_params(f"config key '{where}.pretrain'", PRETRAIN_PARAMS, pretrain)
    settings = {k: v for k, v in settings.items() if not (k in OPTIONAL_KEYS and v is None)}
    if "styles" in settings:
        from ..data.domains.shifted import check_styles

        check_styles(f"config key '{where}.pretrain'", settings["styles"])
    backbone = {k: model["params"][k] for k in ("backbone", "backbone_args")}
    check_pretrainable(backbone, settings["batch_size"], f"config key '{where}.params.backbone_args'")
    spec = {"dataset": dataset, "dataset_params": dataset_params, "backbone": backbone, **settings}
    return {"spec": spec, "out": f"{PRETRAINED_DIR}/{dataset}/{short_hash(spec)}.pt"}


def check_spec(spec: Any) -> None:
    """ConfigError naming what is wrong with a pretraining spec given by hand (`pretrain_spec` writes
    the workflow's): its keys, its dataset and its settings, before any data is read."""
    keys = {"dataset", "dataset_params", "backbone", *PRETRAIN_PARAMS}
    if not isinstance(spec, dict) or not keys - set(OPTIONAL_KEYS) <= set(spec) <= keys:
        have = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ConfigError(f"argument --spec has keys {show(have)}; allowed: exactly {sorted(keys - set(OPTIONAL_KEYS))}, "
                          f"optionally {list(OPTIONAL_KEYS)} (as the workflow's pretrain_backbone rule writes them)")
    if spec["dataset"] not in PROXY_SOURCES:
        raise ConfigError(f"argument --spec: key 'dataset' has value {show(spec['dataset'])}; allowed: a dataset with a "
                          f"held-out proxy, {sorted(PROXY_SOURCES)}")
    resolve_params("argument --spec", PRETRAIN_PARAMS, {k: spec[k] for k in PRETRAIN_PARAMS if k in spec})
    backbone = spec["backbone"]
    if not (isinstance(backbone, dict) and isinstance(backbone.get("backbone"), str)
            and isinstance(backbone.get("backbone_args"), dict)):
        raise ConfigError(f"argument --spec: key 'backbone' has value {show(backbone)}; allowed: "
                          "{backbone: <timm name>, backbone_args: {...}}")
    try:
        check_pretrainable(backbone, spec["batch_size"], "key 'backbone.backbone_args'")
    except ConfigError as exc:
        raise ConfigError(f"argument --spec: {exc}") from None


#: The copies of the backbone's parameters pre-training holds: weights, gradients and AdamW's two moments.
ADAMW_STATES = 4
#: The channels the proxy's images have (shifted_domains renders RGB) where backbone_args does not say.
PROXY_CHANNELS = 3


def check_pretrainable(backbone: dict, batch_size: int, where: str) -> None:
    """ConfigError, one line, where `pretrain_backbone` could not pre-train `backbone` {backbone,
    backbone_args}: a model that is no ViT with a class token, backbone_args that are no ViT's (a
    checkpoint_path among them) or that timm refuses (models.prompted_vit.meta_backbone), or more memory
    than this machine has for AdamW on batches of `batch_size` (check_backbone_memory: a lower bound)."""
    from .prompted_vit import check_backbone_memory, meta_backbone

    args = {"in_chans": PROXY_CHANNELS, **backbone["backbone_args"]}
    net = meta_backbone(backbone["backbone"], args)
    check_backbone_memory(net, where, backbone["backbone_args"], batch_size, ADAMW_STATES, what="pre-training")


def pretrain_backbone(spec: dict, root: Path, out: Path, threads: int | None = None) -> dict[str, float]:
    """Train backbone + a linear classifier on the proxy (cross-entropy, AdamW, cosine lr), save the
    backbone's state dict atomically to `out`; returns the final epoch's loss and accuracy."""
    from .prompted_vit import WEIGHTS_NONE, build_backbone

    check_spec(spec)
    if threads:
        torch.set_num_threads(threads)
    seed = spec["seed"]
    x, y, num_classes = PROXY_SOURCES[spec["dataset"]](Path(root), spec["dataset_params"], spec["samples"], seed,
                                                       spec.get("styles"))
    x = (torch.from_numpy(x).float() / 255.0 - 0.5) / 0.5  # the datasets' Normalize((0.5,)*3, (0.5,)*3)
    y = torch.from_numpy(np.asarray(y, dtype=np.int64))
    torch.manual_seed(derive_seed(seed, "pretrain-init"))
    args = {"in_chans": x.shape[1], **spec["backbone"]["backbone_args"]}
    net = build_backbone(spec["backbone"]["backbone"], args, WEIGHTS_NONE, spec["batch_size"], ADAMW_STATES)
    head = torch.nn.Linear(net.embed_dim, num_classes)
    params = list(net.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.05)
    steps = spec["epochs"] * -(-len(y) // spec["batch_size"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(derive_seed(seed, "pretrain-batches"))
    img = tuple(net.patch_embed.img_size)
    for epoch in range(spec["epochs"]):
        perm = torch.randperm(len(y), generator=g)
        total, correct = 0.0, 0
        for i in range(0, len(y), spec["batch_size"]):
            idx = perm[i : i + spec["batch_size"]]
            xb = x[idx]
            if tuple(xb.shape[-2:]) != img:
                xb = F.interpolate(xb, size=img, mode="bilinear", align_corners=False)
            logits = head(net(xb))
            loss = F.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
        stats = {"epoch": epoch + 1, "loss": total / len(y), "train_acc": correct / len(y)}
        print(f"[fedrepro] pretrain epoch {epoch + 1}/{spec['epochs']}: loss {stats['loss']:.4f}, "
              f"acc {stats['train_acc']:.4f}", file=sys.stderr, flush=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        torch.save(net.state_dict(), tmp)
    return stats
