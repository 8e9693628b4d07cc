"""FedGCR's domain-FL baselines: FedSAM (SAM's two-step update), HarmoFL (amplitude normalisation,
weight perturbation) and FedMix (mean-augmented approximate mixup), on the prompted tiny ViT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedrepro.methods._perturbed import perturbed_step
from fedrepro.methods.fedmix import fedmix_loss, mean_augmented
from fedrepro.models.prompted_vit import AMPLITUDE_KEY, amplitude_normalize, mean_amplitude
from test_fedgcr import domain_partition, gcr_engine  # noqa: F401  (the fixture)


def test_sam_two_step_update_on_a_quadratic():
    # L(w) = 0.5 * sum(a * w^2): grad = a * w. SAM: e = rho g/||g||, step with the gradient at w + e.
    a = torch.tensor([1.0, 3.0])
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    rho = 0.5

    def closure():
        loss = 0.5 * (a * w**2).sum()
        loss.backward()
        return loss

    w0 = w.detach().clone()
    g = a * w0
    e = rho * g / g.norm()
    expected = w0 - 0.1 * a * (w0 + e)
    loss = perturbed_step([w], closure, rho, opt)
    assert torch.allclose(w.detach(), expected)
    assert loss.item() == pytest.approx(0.5 * float((a * w0**2).sum()))
    # rho = 0 is plain SGD: the perturbation is what differs
    w.data.copy_(w0)
    perturbed_step([w], closure, 0.0, opt)
    assert torch.allclose(w.detach(), w0 - 0.1 * a * w0)


def test_amplitude_normalisation_keeps_phase_and_takes_the_shared_amplitude():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 8, 8, generator=g)
    other = torch.rand(6, 3, 8, 8, generator=g) * 3
    amp = mean_amplitude(other)
    out = amplitude_normalize(x, amp)
    spec_in, spec_out = torch.fft.fft2(x), torch.fft.fft2(out)
    assert torch.allclose(spec_out.abs(), amp.expand_as(spec_out), atol=1e-4)
    keep = spec_in.abs() > 1e-3
    assert torch.allclose(torch.polar(torch.ones_like(spec_in.abs()), spec_out.angle())[keep],
                          torch.polar(torch.ones_like(spec_in.abs()), spec_in.angle())[keep], atol=1e-3)
    assert torch.allclose(amplitude_normalize(x, mean_amplitude(x[:1])[None])[0], x[0], atol=1e-5)


def test_dc_amplitude_normalisation_replaces_the_zero_frequency_only(domain_partition, make_cell):  # noqa: F811
    """Issue 27: `amplitude: dc` is the FedGCR code's AmpNorm at L = 0 (utils/amp_utils.pyx): only the
    DC amplitude takes the shared value; every other frequency keeps the image's own amplitude and phase."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 3, 8, 8, generator=g)
    amp = mean_amplitude(torch.rand(6, 3, 8, 8, generator=g) * 3)
    spec_in, spec_out = torch.fft.fft2(x), torch.fft.fft2(amplitude_normalize(x, amp, "dc"))
    assert torch.allclose(spec_out[..., 0, 0].abs(), amp[..., 0, 0].expand(4, 3), atol=1e-4)
    rest = torch.ones(8, 8, dtype=torch.bool)
    rest[0, 0] = False
    assert torch.allclose(spec_out[..., rest], spec_in[..., rest], atol=1e-4)
    engine = gcr_engine(domain_partition, make_cell, method="harmofl", rounds=1, hparams={"amplitude": "dc"})
    engine.run()
    assert engine.model.extractor.amp_scope == "dc"
    assert gcr_engine(domain_partition, make_cell, method="harmofl", rounds=1).method.hp["amplitude"] == "dc"


@pytest.mark.parametrize("scope", ["dc", "spectrum"])
def test_amplitude_normalisation_of_standardised_inputs_is_that_of_the_raw_images(scope):
    """HarmoFL normalises raw intensities (>= 0; med-air/HarmoFL feeds ToTensor images), the engine hands
    the model standardised ones: with the signed zero frequency the result is the raw images' normalised,
    standardised. Before, |DC| was averaged and each image kept its own DC sign, so on fedgcr_cpu's
    Normalize(0.5, 0.5) inputs an image darker than 0.5 went to mean -A and a brighter one to +A."""
    g = torch.Generator().manual_seed(2)
    raw, ref = torch.rand(5, 3, 8, 8, generator=g) * 0.6, torch.rand(7, 3, 8, 8, generator=g)
    raw[0] += 0.4  # one bright image (mean above the standardisation mean), the others darker
    mu, sd = torch.tensor([0.5, 0.4, 0.6]).view(1, 3, 1, 1), torch.tensor([0.5, 0.25, 0.3]).view(1, 3, 1, 1)
    expected = (amplitude_normalize(raw, mean_amplitude(ref), scope) - mu) / sd
    got = amplitude_normalize((raw - mu) / sd, mean_amplitude((ref - mu) / sd), scope)
    assert torch.allclose(got, expected, atol=1e-4)
    if scope == "dc":  # every image takes the shared mean intensity, the bright one too
        means = got.mean((-2, -1))
        assert torch.allclose(means, means[:1].expand_as(means), atol=1e-5)


@pytest.mark.parametrize("optimizer", [{"name": "adamw", "lr": 0.003, "weight_decay": 1e-4}, {"name": "adam", "lr": 0.01}])
def test_qffl_with_L_one_over_lr_under_an_adaptive_optimizer_is_refused(optimizer):
    """q-FedAvg's L (w - w_k) stands for the gradient only under local SGD with step 1/L (Li et al., ICLR
    2020, Algorithm 3). Under AdamW (fedgcr_cpu, lr 3e-3) q L ||w - w_k||^2 / F_k was 5.5-6.7, the server
    moved 11-14 % of FedAvg's step and q-FFL ended at Avg 44.4 against FedAvg's 61.6 (61.8 at q = 0).
    `fedrepro validate` refuses it; an explicit L or the label trained with plain SGD pass."""
    from pathlib import Path

    import yaml

    from fedrepro.config import resolve_experiment
    from fedrepro.registry import ConfigError

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "test.yaml").read_text())
    config["methods"] = {"qffl": {}}
    config["training"]["optimizer"] = optimizer
    with pytest.raises(ConfigError, match=rf"methods\.qffl\.hparams\.lipschitz' has value null.*with {optimizer['name']}"
                                          rf".*methods\.qffl\.training\.optimizer"):
        resolve_experiment(config)
    config["methods"]["qffl"] = {"hparams": {"lipschitz": 10.0}}
    resolve_experiment(config)  # an explicit L
    config["methods"]["qffl"] = {"training": {"optimizer": {"name": "sgd", "lr": 0.1}}}
    resolve_experiment(config)  # q-FFL's own local solver: plain SGD, L = 1/lr


def test_harmofl_clients_train_with_the_global_amplitude_after_round_one(domain_partition, make_cell, monkeypatch):  # noqa: F811
    """Issue 27: from round 2 on every client normalises with the averaged A (HarmoFL; the code copies it
    into every client, utils/util.py:1051-1066). Before the fix the global A was never sent: a client
    trained with whatever A the shared model object held last (the previous client's own, round 1)."""
    import fedrepro.methods.harmofl as harmofl

    engine = gcr_engine(domain_partition, make_cell, method="harmofl", rounds=3)
    engine.training["eval_every"] = 100  # no evaluation loads the global model in between
    seen = []
    fit = harmofl.perturbed_fit

    def recording(eng, client, radius):
        seen.append((eng.round, client.id, eng.model.extractor.amplitude.clone()))
        return fit(eng, client, radius)

    monkeypatch.setattr(harmofl, "perturbed_fit", recording)
    metrics = engine.run()
    clients = engine.clients
    n = torch.tensor([c.num_train for c in clients], dtype=torch.float64)
    global_amp = sum(float(w) * mean_amplitude(c.train.x) for w, c in zip(n / n.sum(), clients))
    later = [a for r, _, a in seen if r > 1]
    assert len(later) == 2 * len(clients) and all(torch.allclose(a, global_amp, atol=1e-5) for a in later)
    down = metrics["communication"]["bytes_down_per_round"]
    assert down[1] - down[2] == global_amp.numel() * 4 * len(clients)  # A goes down once, in round 2


def test_harmofl_shares_the_amplitude_once_and_normalises_evaluation(domain_partition, make_cell):  # noqa: F811
    engine = gcr_engine(domain_partition, make_cell, method="harmofl", rounds=2)
    metrics = engine.run()
    clients = engine.clients
    n = torch.tensor([c.num_train for c in clients], dtype=torch.float64)
    expected = sum(float(w) * mean_amplitude(c.train.x) for w, c in zip(n / n.sum(), clients))
    assert torch.allclose(engine.method.server["global"][AMPLITUDE_KEY], expected, atol=1e-5)
    assert engine.model.extractor.amp_norm_on
    amp_bytes = expected.numel() * 4 * len(clients)
    up = metrics["communication"]["bytes_up_per_round"]
    assert up[0] - up[1] == amp_bytes  # sent in round 1 only
    fedavg = gcr_engine(domain_partition, make_cell, method="fedavg", rounds=1).run()
    assert fedavg["communication"]["bytes_up_per_round"][0] == up[1]  # otherwise the same upload as FedAvg


def test_fedsam_differs_from_fedavg_only_by_the_perturbation(domain_partition, make_cell):  # noqa: F811
    def final(method, **hp):
        engine = gcr_engine(domain_partition, make_cell, method=method, rounds=1, hparams=hp)
        engine.run()
        return engine.method.server["global"]

    avg, sam0, sam = final("fedavg"), final("fedsam", rho=0.0), final("fedsam")
    assert all(torch.allclose(avg[k], sam0[k], atol=1e-6) for k in avg)
    assert any(not torch.allclose(avg[k], sam[k]) for k in avg)


def test_fedmix_loss_and_means():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    x, y = torch.randn(5, 3, 2, 2), torch.tensor([0, 1, 2, 0, 1])
    xm, ym = torch.randn(5, 3, 2, 2), F.one_hot(torch.tensor([2, 2, 0, 1, 0]), 3).float()
    assert fedmix_loss(model, x, y, xm, ym, 0.0).item() == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    lam = 0.3
    xs = ((1 - lam) * x).requires_grad_(True)
    logits = model(xs)
    ce = F.cross_entropy(logits, y, reduction="none")
    (grad,) = torch.autograd.grad(ce.sum(), xs)
    expected = ((1 - lam) * ce - lam * (ym * F.log_softmax(logits, 1)).sum(1) + lam * (grad * xm).flatten(1).sum(1)).mean()
    assert fedmix_loss(model, x, y, xm, ym, lam).item() == pytest.approx(expected.item(), rel=1e-5)
    xs_mean, ys_mean = mean_augmented(torch.arange(12.0).reshape(6, 2), torch.tensor([0, 0, 1, 1, 2, 2]), 3, 3,
                                      torch.Generator().manual_seed(0))
    assert xs_mean.shape == (2, 2) and torch.allclose(ys_mean.sum(1), torch.ones(2))
    assert torch.allclose(xs_mean.mean(0), torch.arange(12.0).reshape(6, 2).mean(0))


def test_fedmix_pools_the_means_in_round_one(domain_partition, make_cell):  # noqa: F811
    engine = gcr_engine(domain_partition, make_cell, method="fedmix", rounds=2)
    metrics = engine.run()
    pool_x, pool_y = engine.method.server["pool"]
    assert len(pool_y) == sum(c.num_train // 5 for c in engine.clients)
    up = metrics["communication"]["bytes_up_per_round"]
    assert up[0] - up[1] == pool_x.numel() * 4 + pool_y.numel() * 4
