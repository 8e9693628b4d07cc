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
"""

from __future__ import annotations

from ..models.prompted_vit import AMPLITUDE_KEY, mean_amplitude
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
    }

    models = ("prompted_vit",)

    def setup(self):
        model = self.engine.model
        if not hasattr(model, "use_amp_norm"):
            raise ConfigError("method 'harmofl': needs a model with amplitude normalisation; allowed model: prompted_vit")
        model.use_amp_norm(True)  # the amplitude is part of the model from now on (it travels in round 1)
        super().setup()

    def broadcast(self, client):
        payload = super().broadcast(client)
        if self.engine.round > 1:  # A is fixed after round 1: it is not sent again
            payload.pop(AMPLITUDE_KEY, None)
        return payload

    def local_update(self, client, payload):
        engine = self.engine
        engine.set_params(payload)
        first = engine.round <= 1
        if first:
            engine.set_params({AMPLITUDE_KEY: mean_amplitude(client.train.x)})
        fit = perturbed_fit(engine, client, self.hp["alpha"])
        params = engine.get_params(self.shared)
        if not first:
            params.pop(AMPLITUDE_KEY, None)
        return Update(client.id, client.num_train, params, loss=fit.loss)
