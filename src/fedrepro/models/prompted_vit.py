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

from pathlib import Path
from typing import Sequence

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


def build_backbone(name: str, args: dict, weights: str) -> nn.Module:
    import timm
    from timm.models.vision_transformer import VisionTransformer

    if not timm.is_model(name):
        raise ConfigError(f"model 'prompted_vit': key 'backbone' has value {show(name)}; allowed: a timm ViT name, e.g. "
                          f"{timm.list_models('vit_*')[:6]}")
    kwargs = {**args, "num_classes": 0, "global_pool": "token"}
    try:
        net = timm.create_model(name, pretrained=weights == WEIGHTS_TIMM, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"model 'prompted_vit': key 'backbone_args' has value {show(args)}; allowed: keyword arguments "
                          f"of timm's VisionTransformer ({exc})") from None
    if not isinstance(net, VisionTransformer) or getattr(net, "cls_token", None) is None:
        raise ConfigError(f"model 'prompted_vit': key 'backbone' has value {show(name)}; allowed: a timm VisionTransformer "
                          f"with a class token")
    if weights not in (WEIGHTS_TIMM, WEIGHTS_NONE):
        load_backbone_weights(net, weights)
    return net


def _input_check(sample_shape: Sequence[int], params: dict) -> str | None:
    """Why a prompted_vit with `params` cannot take samples of `sample_shape`: backbone_args that timm
    refuses, or `resize: false` with sides other than the backbone's img_size. The backbone is built on
    the meta device (no weights, no memory; milliseconds once timm is imported), before any job."""
    args = {"in_chans": int(sample_shape[0]), **(params.get("backbone_args") or {})}
    try:
        with torch.device("meta"):
            net = build_backbone(params["backbone"], args, WEIGHTS_NONE)
    except ConfigError as exc:
        return str(exc)
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        return f"timm cannot build {params['backbone']!r} with backbone_args {show(args)} ({exc})"
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
