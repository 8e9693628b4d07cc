"""HarmoFL (Jiang, Wang, Dou, "HarmoFL: Harmonizing Local and Global Drifts in Federated Learning
on Heterogeneous Medical Images", AAAI 2022), a domain-FL baseline of FedGCR (methods.md §5.5, §6).

(i) Amplitude normalisation (local drift in the input space): every image keeps its Fourier phase
    and takes a shared amplitude spectrum A. Round 1: each client normalises with the mean
    amplitude of its own train images and uploads it with its model; the server averages the
    amplitudes (data-size weighted) once; from round 2 on every client and the evaluation use that
    global A (fixed). Needs a model with the capability (`prompted_vit`: `use_amp_norm`).
(ii) Weight perturbation (global drift): WPOptim, i.e. per mini-batch, perturb the weights by
    alpha g / ||g||, take the gradient there, restore and step the base optimizer
    (`_perturbed.perturbed_step`; alpha = 0.05, the fedgcr code's WPOptim(Adam, lr 1e-2, alpha 0.05)).
The server averages the uploads as FedAvg (prompts + head, and A in round 1).
`amplitude: dc` (default) replaces only the zero-frequency amplitude, the per-channel mean intensity:
HarmoFL's own code (med-air/HarmoFL `utils/amp_utils.pyx`: `process` -> `normalize(..., L=0)`, whose
low-frequency window has half-width floor(min(H, W) * L) = 0) and the FedGCR code's copy of it
(celinezheng/fedgcr `utils/amp_utils.pyx`), the code both papers' numbers come from; `spectrum` replaces
each image's whole amplitude spectrum by A (a phase-only image of A's power): through the frozen,
never amplitude-normalised backbone of fedgcr_cpu it costs every client type 20-30 points (Avg 38.8
against 58.2 with `dc` and FedAvg's 61.6, seed 0, 30 rounds; issue 27 measured 37.16 against 56.49
at 10 rounds). Before this default changed, `spectrum` was the default ("HarmoFL's amplitude
normalisation as read here", without the HarmoFL code).
HarmoFL normalises raw intensities (ToTensor, >= 0); the engine's inputs are standardised, so the
zero frequency is kept signed (`models/prompted_vit.py` `mean_amplitude`): the normalisation of the
standardised image is that of the raw image, standardised (before, an image darker than the
standardisation mean kept its negative DC and went to mean -A: Avg 56.78 with `dc`, 58.23 after).
"""

from __future__ import annotations

from ..models.prompted_vit import AMPLITUDE_KEY, AMPLITUDE_SCOPES, mean_amplitude
from ..registry import ConfigError, Param
from . import register
from ._perturbed import perturbed_fit
from .base import Update
from .fedavg import FedAvg


@register
class HarmoFL(FedAvg):
    name = "harmofl"
    summary = "HarmoFL: amplitude-normalised inputs (shared Fourier amplitude) + weight-perturbed local steps, FedAvg"
    paper = "Jiang, Wang, Dou, AAAI 2022"
    hparams = {
        "alpha": Param(0.05, "weight-perturbation radius alpha (HarmoFL and the fedgcr code: 0.05)", float, minimum=0),
        "amplitude": Param("dc", "what the shared amplitude A replaces: 'dc' = only each image's zero-frequency amplitude "
                                 "(HarmoFL's own AmpNorm, med-air/HarmoFL utils/amp_utils.pyx at L = 0, as the FedGCR "
                                 "code's copy); 'spectrum' = its whole amplitude spectrum",
                           str, choices=AMPLITUDE_SCOPES),
    }
    cost_passes = 2.0  # the gradient at w and again at the perturbed w + e: two steps a batch

    models = ("prompted_vit",)

    def setup(self):
        model = self.engine.model
        if not hasattr(model, "use_amp_norm"):
            raise ConfigError("method 'harmofl': needs a model with amplitude normalisation; allowed model: prompted_vit")
        model.use_amp_norm(True, self.hp["amplitude"])  # the amplitude is part of the model from now on (it travels in round 1)
        super().setup()

    def broadcast(self, client):
        payload = super().broadcast(client)
        if self.engine.round != 2:  # the global A goes down once, in round 2 (the round-1 buffer is replaced anyway)
            payload.pop(AMPLITUDE_KEY, None)
        return payload

    def local_update(self, client, payload):
        engine = self.engine
        engine.set_params(payload)
        first = engine.round <= 1
        if first:
            engine.set_params({AMPLITUDE_KEY: mean_amplitude(client.train.x)})
        else:  # every later round trains with the global A the client received in round 2 (the code's
            # communication() copies the averaged running_amp into every client and fixes it, utils/util.py:1051-1066)
            if AMPLITUDE_KEY in payload:
                client.state["amplitude"] = payload[AMPLITUDE_KEY].clone()
            engine.set_params({AMPLITUDE_KEY: client.state["amplitude"]})
        fit = perturbed_fit(engine, client, self.hp["alpha"])
        params = engine.get_params(self.shared)
        if not first:
            params.pop(AMPLITUDE_KEY, None)
        return Update(client.id, client.num_train, params, loss=fit.loss)
