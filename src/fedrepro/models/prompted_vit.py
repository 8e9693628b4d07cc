"""`prompted_vit`: a frozen timm Vision Transformer tuned through prompts (FedGCR's FedGC model).

Cheng et al., "FedGCR", AAAI 2024, §"Group Customization" and methods.md §5.1:

* backbone: a timm ViT (ImageNet weights in the paper), **frozen**; its CLS output is the feature;
* P learnable global prompts p (P x d, init N(0, 0.02^2)) **appended** after the positional
  embeddings to [CLS + patch tokens] (shallow VPT; prompts carry no positional embedding);
* GC-Net: Linear(d -> 4d) -> ReLU -> Linear(4d -> d) maps the prompt-free CLS embedding r of a
  sample to its type-specific prompt h; every global prompt of *that sample* becomes p_j + h
  (the paper's semantics; the code's `repeat(P, 1).reshape(B, P, d)` mixes samples, not copied);
* head: Linear(d -> C) (the code's `nonlinear_classifier=False`); FedGCR replaces it by the paper's MLP
  head unless `head: linear` (methods/fedgcr.py).

Only the prompts, the GC-Net and the head train: `SplitModel.frozen_prefixes` names the backbone,
so `Engine.get_params` never returns it and no method ever sends it (communication bytes count the
prompts, GC-Net and head only). With `gc_net: false` the model is the plain prompted ViT the
paper's baselines tune (prompts + head): the GC-Net is used only where a method (FedGCR) switches it on.

Weights: `weights: timm` loads timm's pretrained (ImageNet) weights from the model hub (needs
internet); `weights: none` keeps the seeded random initialisation (tests); any other value is a
local checkpoint (a state dict of the backbone, e.g. written by `fedrepro pretrain-backbone`).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import ConfigError, Param, show
from .base import MAX_WIDTH, MODELS, SplitModel

BACKBONE_PREFIX = "extractor.backbone."
GC_NET_PREFIX = "extractor.gc_net."
AMPLITUDE_KEY = "extractor.amplitude"


def mean_amplitude(x: torch.Tensor) -> torch.Tensor:
    """Mean over the images of their Fourier amplitude spectra |FFT2(x)| (C, H, W) (HarmoFL's AmpNorm),
    except the zero frequency, which keeps its sign: entry [..., 0, 0] is the mean of the real DC
    coefficient (H W times the mean intensity), not the mean of its absolute value.

    HarmoFL (Jiang, Wang, Dou, AAAI 2022; med-air/HarmoFL `utils/amp_utils.pyx`, `federated/fed_train.py`)
    normalises raw intensities (ToTensor only, >= 0), whose DC coefficient is always positive. The
    engine hands the model standardised inputs x_s = (x - mu) / sigma, whose DC is negative for an image
    darker than mu: averaging |DC| and keeping each image's DC sign sent a dark image to mean -A and a
    bright one to +A (a sign flip, not a harmonisation). With the signed DC, amplitude normalisation of
    x_s is exactly that of the raw x, standardised (every non-zero frequency is sigma times the raw one,
    the DC is shifted by mu H W): `tests/test_fedgcr_baselines.py`."""
    spectrum = torch.fft.fft2(x)
    amp = spectrum.abs().mean(0)
    amp[..., 0, 0] = spectrum[..., 0, 0].real.mean(0)
    return amp


AMPLITUDE_SCOPES = ("spectrum", "dc")


def amplitude_normalize(x: torch.Tensor, amplitude: torch.Tensor, scope: str = "spectrum") -> torch.Tensor:
    """Each image keeps its phase and takes the shared amplitude: IFFT2(A exp(i phase(FFT2(x))))
    (HarmoFL, Jiang, Wang, Dou, AAAI 2022, amplitude normalisation). `scope: dc` (HarmoFL's own code and
    the FedGCR code: `normalize(x, running_amp, L=0)`, whose low-frequency window has half-width
    floor(min(H, W) * L) = 0, med-air/HarmoFL and celinezheng/fedgcr `utils/amp_utils.pyx`) replaces only
    the zero frequency and keeps the rest of the image's own spectrum; `scope: spectrum` replaces the
    whole amplitude spectrum. The zero frequency is set to the signed mean DC of `mean_amplitude`
    (the raw image's mean intensity, standardised), so that the result does not depend on the
    standardisation of the inputs."""
    spectrum = torch.fft.fft2(x)
    if scope == "dc":
        out = spectrum.clone()
    else:
        out = torch.polar(amplitude.expand_as(spectrum.real).contiguous(), torch.angle(spectrum))
    out[..., 0, 0] = amplitude[..., 0, 0].to(out.dtype)
    return torch.fft.ifft2(out).real


WEIGHTS_TIMM, WEIGHTS_NONE = "timm", "none"


class PromptedViT(nn.Module):
    """The extractor: frozen ViT + appended prompts (+ GC-Net); `encode` gives (z, h, r)."""

    def __init__(self, backbone: nn.Module, num_prompts: int, gc_net: bool, gc_hidden_mult: int,
                 feature_dropout: float, resize: bool, sample_shape: Sequence[int]):
        super().__init__()
        self.backbone = backbone
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        d = backbone.embed_dim
        self.prompts = nn.Parameter(torch.randn(num_prompts, d) * 0.02)
        self.gc_net = nn.Sequential(nn.Linear(d, gc_hidden_mult * d), nn.ReLU(), nn.Linear(gc_hidden_mult * d, d)) if gc_net else None
        self.dropout = nn.Dropout(feature_dropout)  # the code's featurizer dropout on the output (0.1)
        self.type_prompt_on = False  # FedGCR switches the GC-Net on (`PromptedSplitModel.use_type_prompt`)
        # HarmoFL's amplitude normalisation of the inputs (`use_amp_norm`): the shared amplitude spectrum
        self.register_buffer("amplitude", torch.zeros(tuple(sample_shape)))
        self.amp_norm_on = False
        self.amp_scope = "spectrum"  # HarmoFL's `amplitude` hyper-parameter (`use_amp_norm`)
        self.resize = resize
        self.img_size = tuple(backbone.patch_embed.img_size) if getattr(backbone.patch_embed, "img_size", None) else None

    def train(self, mode: bool = True) -> "PromptedViT":
        super().train(mode)
        self.backbone.eval()  # frozen: its dropout / drop-path never act
        return self

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[CLS + patch tokens] after the positional embeddings (the prompts go after these)."""
        if self.amp_norm_on:
            x = amplitude_normalize(x, self.amplitude, self.amp_scope)
        if self.resize and self.img_size is not None and tuple(x.shape[-2:]) != self.img_size:
            x = F.interpolate(x, size=self.img_size, mode="bilinear", align_corners=False)  # the paper resizes to 224
        bb = self.backbone
        return bb.norm_pre(bb.patch_drop(bb._pos_embed(bb.patch_embed(x))))

    def cls(self, tokens: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """CLS output of the transformer on `tokens` with `prompts` (B, P, d) appended."""
        if prompts is not None:
            tokens = torch.cat([tokens, prompts], dim=1)
        bb = self.backbone
        return bb.forward_head(bb.norm(bb.blocks(tokens)), pre_logits=True)

    def combined_prompts(self, r: torch.Tensor, prompts: torch.Tensor | None = None,
                         gc_params: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(p_bar (B, P, d), h (B, d) or None): h = GC-Net(r), one type-specific prompt per sample,
        added to every global prompt of that sample. `prompts` / `gc_params` stand in for the
        module's own (another model's prompts and GC-Net on the same tokens: FedGCR's z_0, z_prev)."""
        prompts = self.prompts if prompts is None else prompts
        h = None
        if self.type_prompt_on:
            h = self.gc_net(r) if gc_params is None else torch.func.functional_call(self.gc_net, gc_params, (r,))
        p_bar = prompts.unsqueeze(0).expand(len(r), -1, -1)
        if h is not None:
            p_bar = p_bar + h.unsqueeze(1)  # p_bar_{b,j} = p_j + h_b: sample b's own h in every slot
        return p_bar, h

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(z, h, r): prompted CLS feature, type-specific prompt, prompt-free CLS embedding."""
        tokens = self.tokens(x)
        with torch.no_grad():
            r = self.cls(tokens)  # stage 1: no prompts, no gradient
        p_bar, h = self.combined_prompts(r)
        return self.dropout(self.cls(tokens, p_bar)), h, r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)[0]


class PromptedSplitModel(SplitModel):
    """The prompted ViT as a `SplitModel`. The GC-Net is a capability that FedGCR switches on; while it
    is off (every other method: plain prompt tuning, as the paper's baselines) it neither trains nor
    travels (it joins the frozen prefixes)."""

    def use_type_prompt(self, on: bool) -> None:
        ext = self.extractor
        if on and ext.gc_net is None:
            raise ConfigError("model 'prompted_vit': a type-specific prompt needs the GC-Net; allowed: the model's "
                              "gc_net: true")
        ext.type_prompt_on = on
        if ext.gc_net is not None:
            for p in ext.gc_net.parameters():
                p.requires_grad_(on)
        self._refreeze()

    def use_amp_norm(self, on: bool, scope: str = "spectrum") -> None:
        """HarmoFL: normalise every input's amplitude spectrum (`scope`: the whole spectrum, or the
        zero-frequency amplitude only) to `extractor.amplitude` (which then travels)."""
        if scope not in AMPLITUDE_SCOPES:
            raise ValueError(f"amplitude scope {scope!r}; allowed: {', '.join(AMPLITUDE_SCOPES)}")
        self.extractor.amp_norm_on = on
        self.extractor.amp_scope = scope
        self._refreeze()

    def _refreeze(self) -> None:
        ext = self.extractor
        unused_gc = ext.gc_net is not None and not ext.type_prompt_on
        self.frozen_prefixes = ((BACKBONE_PREFIX,) + ((GC_NET_PREFIX,) if unused_gc else ())
                                + (() if ext.amp_norm_on else (AMPLITUDE_KEY,)))


def load_backbone_weights(backbone: nn.Module, path: str) -> None:
    """Load a local checkpoint (a backbone state dict, `.pt`/`.pth` or `.safetensors`); head keys
    the backbone lacks (num_classes = 0) are ignored, any other mismatch is an error."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"model 'prompted_vit': key 'weights' has value {show(path)}, a checkpoint file that does not exist; allowed: "
            f"'{WEIGHTS_TIMM}' (timm's pretrained weights, needs internet), '{WEIGHTS_NONE}' (random) or the path of a "
            f"backbone state dict (write one with `fedrepro pretrain-backbone`)")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
    missing, unexpected = backbone.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if not k.startswith("head.")]
    if missing or unexpected:
        raise ConfigError(f"model 'prompted_vit': checkpoint {file} does not fit the backbone: missing {show(missing)}, "
                          f"unexpected {show(unexpected)}; allowed: a state dict of the configured backbone")


#: Keyword arguments of timm's VisionTransformer that build_backbone sets itself (num_classes, global_pool)
#: or that are no part of the architecture (the engine places the model and computes in float32).
RESERVED_BACKBONE_ARGS = ("num_classes", "global_pool", "device", "dtype")
#: ViTs to name where a backbone is refused (timm.list_models('vit_*') starts with 5-billion-parameter ones).
VIT_EXAMPLES = ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"]
#: Bytes of one float32 value: the backbone's parameters and activations.
VALUE_BYTES = 4


def machine_memory_bytes() -> int | None:
    """This machine's physical memory in bytes; None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def backbone_arg_names() -> list[str]:
    """What `backbone_args` may hold: the architecture's keyword arguments of timm's VisionTransformer.
    (timm.create_model takes more, e.g. checkpoint_path, which loads a file: a checkpoint goes in
    `weights`, which load_backbone_weights reads with weights_only.)"""
    from timm.models.vision_transformer import VisionTransformer

    names = inspect.signature(VisionTransformer.__init__).parameters
    return [k for k in names if k != "self" and k not in RESERVED_BACKBONE_ARGS]


def _require_vit(name: Any) -> None:
    """ConfigError unless `name` is a timm model that is a VisionTransformer with a class token (its default
    architecture built on the meta device: no memory): what `prompted_vit` prompts and pretraining trains."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(name, str) or not timm.is_model(name):
        raise ConfigError(f"model 'prompted_vit': key 'backbone' has value {show(name)}; allowed: a timm ViT name, e.g. "
                          f"{VIT_EXAMPLES}")
    try:
        with torch.device("meta"):
            net = timm.create_model(name, pretrained=False)
    except (TypeError, ValueError, AssertionError, RuntimeError, KeyError, IndexError):
        net = None  # (a model timm cannot build at its defaults is no backbone either)
    if not isinstance(net, VisionTransformer) or getattr(net, "cls_token", None) is None:
        raise ConfigError(f"model 'prompted_vit': key 'backbone' has value {show(name)}; allowed: a timm VisionTransformer "
                          f"with a class token, e.g. {VIT_EXAMPLES}")


def meta_backbone(name: str, args: dict) -> nn.Module:
    """The backbone `name` with `args` built on the meta device (no weights, no memory; milliseconds once
    timm is imported): ConfigError, one line, for what cannot be built, before anything is allocated or
    read: a model that is no ViT with a class token, a key that is no architecture argument of timm's
    VisionTransformer, or arguments timm refuses."""
    import timm

    _require_vit(name)
    allowed = backbone_arg_names()
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise ConfigError(f"model 'prompted_vit': key 'backbone_args' has key(s) {show(unknown)}; allowed: keyword "
                          f"arguments of timm's VisionTransformer ({', '.join(allowed)}); a checkpoint goes in the "
                          "model's 'weights'")
    kwargs = {**args, "num_classes": 0, "global_pool": "token"}
    try:
        with torch.device("meta"):
            net = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"model 'prompted_vit': key 'backbone_args' has value {show(args)}; allowed: keyword arguments "
                          f"of timm's VisionTransformer ({exc})") from None
    except (ValueError, AssertionError, RuntimeError, KeyError, IndexError) as exc:
        raise ConfigError(f"timm cannot build {name!r} with backbone_args {show(args)} ({exc})") from None
    if getattr(net, "cls_token", None) is None:  # its CLS output is the feature (PromptedViT.cls)
        raise ConfigError(f"model 'prompted_vit': key 'backbone_args' has value {show(args)}; allowed: arguments that "
                          "keep the class token (class_token: true)")
    return net


def _mlp_width(block: nn.Module, dim: int) -> int:
    fc1 = getattr(getattr(block, "mlp", None), "fc1", None)
    return fc1.out_features if isinstance(fc1, nn.Linear) else dim


def backbone_bytes(net: nn.Module, batch: int = 1, states: int = 1, extra_tokens: int = 0) -> tuple[int, int, int]:
    """(parameters, bytes of weights, bytes of activations): a lower bound of what training ViT `net` holds.
    Weights: its parameters and buffers `states` times (1: a frozen backbone; 4: pre-training with AdamW,
    weights, gradients and two moments). Activations, per sample of a batch of `batch`: what each block
    keeps for the backward pass, at least its input, q, k, v, the attention output and the MLP's hidden
    layer before and after its activation, over the patch, prefix and `extra_tokens` (prompts) tokens,
    float32. Attention scores are left out (a fused kernel never stores them), so it only undercounts."""
    params = sum(p.numel() for p in net.parameters()) + sum(b.numel() for b in net.buffers())
    tokens = (getattr(net.patch_embed, "num_patches", None) or 1) + net.num_prefix_tokens + extra_tokens
    dim = net.embed_dim
    per_sample = tokens * dim + sum(tokens * (5 * dim + 2 * _mlp_width(block, dim)) for block in net.blocks)
    return params, params * VALUE_BYTES * states, per_sample * VALUE_BYTES * batch


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_backbone_memory(net: nn.Module, where: str, args: dict, batch: int = 1, states: int = 1,
                          extra_tokens: int = 0, what: str = "training") -> None:
    """ConfigError (`where`: the key of `args`, the backbone_args) where the lower bound backbone_bytes of
    `what` the backbone needs exceeds this machine's memory: refused before a byte is allocated (an
    embed_dim of 65,536 or an img_size of 100,000 tried to allocate 50 GB and more)."""
    memory = machine_memory_bytes()
    params, weights, activations = backbone_bytes(net, batch, states, extra_tokens)
    if memory is not None and weights + activations > memory:
        copies = f" x {states} (weights, gradients, optimizer state)" if states > 1 else ""
        raise ConfigError(f"{where} has value {show(args)}: {what} the backbone needs at least {_gib(weights + activations)} "
                          f"({params:,} parameters{copies}: {_gib(weights)}; the activations of {batch:,} sample(s): "
                          f"{_gib(activations)}); allowed: at most this machine's {_gib(memory)} of memory (a smaller "
                          "img_size, embed_dim or depth)")


def build_backbone(name: str, args: dict, weights: str, batch: int = 1, states: int = 1) -> nn.Module:
    """The backbone (`weights`: timm's, none or a checkpoint), checked first on the meta device (meta_backbone)
    and against this machine's memory for training it with `batch` samples and `states` (check_backbone_memory)."""
    import timm

    meta = meta_backbone(name, args)
    check_backbone_memory(meta, "model 'prompted_vit': key 'backbone_args'", args, batch, states)
    net = timm.create_model(name, pretrained=weights == WEIGHTS_TIMM, **args, num_classes=0, global_pool="token")
    if weights not in (WEIGHTS_TIMM, WEIGHTS_NONE):
        load_backbone_weights(net, weights)
    return net


def _input_check(sample_shape: Sequence[int], params: dict) -> str | None:
    """Why a prompted_vit with `params` cannot take samples of `sample_shape`: a backbone it cannot build
    (meta_backbone: no ViT, backbone_args that are no ViT's or that timm refuses), one that needs more
    memory than this machine has (check_backbone_memory: one sample, its prompts), or `resize: false`
    with sides other than the backbone's img_size. Decided on the meta device (no weights, no memory;
    milliseconds once timm is imported), before any job."""
    args = {"in_chans": int(sample_shape[0]), **(params.get("backbone_args") or {})}
    try:
        net = meta_backbone(params["backbone"], args)
        check_backbone_memory(net, "model 'prompted_vit': key 'backbone_args'", args,
                              extra_tokens=params.get("num_prompts") or 0)
    except ConfigError as exc:
        return str(exc)
    side = tuple(net.patch_embed.img_size)
    if not params.get("resize", True) and tuple(sample_shape[1:]) != side:
        return f"resize: false needs samples of the backbone's img_size {side}, not of shape {tuple(sample_shape)}"
    return None


@MODELS.register(
    "prompted_vit",
    "frozen timm ViT + P appended prompts (+ FedGCR's GC-Net type-specific prompt per sample) | head: linear "
    "(FedGC, Cheng et al. 2024; VPT, Jia et al. 2022)",
    params={
        "backbone": Param("vit_base_patch16_224", "timm model name of the ViT (paper: ViT-B/16, ImageNet)", str),
        "backbone_args": Param({}, "keyword arguments for timm.create_model (e.g. img_size, patch_size, embed_dim, depth, "
                                   "num_heads for a tiny ViT)", dict),
        "weights": Param(WEIGHTS_TIMM, "'timm' = timm's pretrained weights (model hub, needs internet); 'none' = random "
                                       "(tests); otherwise the path of a backbone checkpoint", str),
        "num_prompts": Param(4, "P, the number of global prompts (FedGCR: 4)", int, minimum=1, maximum=1024),
        "gc_net": Param(True, "build GC-Net (FedGC's type-specific prompt, added to every prompt). Only FedGCR switches "
                              "it on; every other method tunes the plain prompts + head (the paper's baselines' VPT), "
                              "and an unused GC-Net neither trains nor travels", bool),
        "gc_hidden_mult": Param(4, "GC-Net hidden width = this x d (MetaNet(768, 1, 768, 3072): 4)", int, minimum=1,
                                maximum=64),
        "feature_dropout": Param(0.1, "dropout on the CLS feature (the code's featurizer Dropout(0.1))", float, minimum=0,
                                 maximum=1),
        "resize": Param(True, "bilinearly resize inputs to the backbone's img_size when they differ (the paper resizes "
                              "to 224)", bool),
    },
    inputs="images (C, H, W); resized on the device to the backbone's img_size",
    input_dims=(3,), input_check=_input_check,
)
def prompted_vit(sample_shape: Sequence[int], num_classes: int, backbone: str = "vit_base_patch16_224",
                 backbone_args: dict | None = None, weights: str = WEIGHTS_TIMM, num_prompts: int = 4, gc_net: bool = True,
                 gc_hidden_mult: int = 4, feature_dropout: float = 0.1, resize: bool = True) -> SplitModel:
    args = {"in_chans": int(sample_shape[0]), **(backbone_args or {})}
    net = build_backbone(backbone, args, weights)
    if net.embed_dim > MAX_WIDTH:
        raise ConfigError(f"model 'prompted_vit': embed_dim {net.embed_dim}; allowed: <= {MAX_WIDTH}")
    extractor = PromptedViT(net, num_prompts, gc_net, gc_hidden_mult, feature_dropout, resize, sample_shape)
    model = PromptedSplitModel(extractor, nn.Linear(net.embed_dim, num_classes), net.embed_dim, frozen_prefixes=(BACKBONE_PREFIX,))
    model.use_type_prompt(False)
    model.use_amp_norm(False)
    return model
