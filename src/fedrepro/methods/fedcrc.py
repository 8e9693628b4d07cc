"""FedCRC (Wang, Xie, Yu, Qu, Zhang, Cao, "Federated Learning with Common Representation
Learning Criterion and Personalized Predictor"; ../shared/papers/fedcrc.txt, §III and
Algorithm 1; spec ../shared/reference/methods.md §1).

Model = extractor f + predictor h (the final linear layer, "head."). Each client i keeps
a persistent local predictor h_i that never leaves it.

Client i, given the global extractor f_g^t and global predictor h_g^t:
  1. f_g' = argmin_f CE(h_g^t(f(x)), y), h_g^t frozen: the common criterion (eq. 4);
  2. h_i' = argmin_h CE(h(z), y), z = f_g^t(x), the received extractor frozen (eq. 5,
     h_i' = argmin L_i(f_g, h_i), and §III-B2: "a local predictor h_i ... using the fixed global
     representation extractor"); `head_extractor: updated` [RECON] takes z = f_g'(x) instead
     (the sequential prose of §III-C and Fig. 2; the default before issue 35);
  3. h_gi = argmin_h CE(h(z), y) + KL(softmax(h_i'(z)) || softmax(h(z))), from h_g^t, on the
     same z, the extractor and h_i' frozen (eqs. 6-7 write f_g too; the paper's KLoss(h_g, h_i) =
     PyTorch's KLDivLoss(log_softmax(h_g logits), softmax(h_i logits)): h_i is the teacher);
  4. upload f_g' and h_gi (and n_i); keep h_i'.
Server: f_g^{t+1} = sum_i (n_i / n) f_gi' (eq. 3; FedAvg over the sampled clients, BatchNorm
buffers included where a model has them, methods.md §1.3); h_g' = sum_i (n_i / n) h_gi
(eq. 8); h_g^{t+1} = tau h_g^t + (1 - tau) h_g' (eq. 9, tau = 0.99, §IV-A3).
The paper writes N = sum over all M clients in eqs. (3)/(8); `weight_norm: sampled` [RECON]
normalises the weights over the clients actually aggregated (the paper's m models, its "model
averaging aggregation"; spec §1.3), else they would not sum to 1; 'all_clients' divides by the
federation's N literally.

Columns: "(global)" = FedCRC = f_g + h_g; "(personal)" = FedCRC-Per = the current f_g + the
client's h_i (§IV-B; methods.md §1.6). Steps 2-3 train only the last layer on a frozen
extractor, so by default the representations are computed once (eval mode, no
augmentation) and reused: the paper's "minimal cost" of predictor training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..registry import Param
from . import register
from .base import FORWARD_SHARE, Method, Params, Passes, Update, select, weighted_average

EPOCHS = (int, type(None))


@register
class FedCRC(Method):
    name = "fedcrc"
    summary = "FedCRC: extractor under a frozen global head; private local head; KL-guided global head, EMA-aggregated"
    paper = "Wang et al., FedCRC (shared/papers/fedcrc.txt)"
    has_global = True  # FedCRC: f_g + h_g
    has_personal = True  # FedCRC-Per: f_g + h_i
    hparams = {
        "tau": Param(0.99, "EMA factor of the global predictor, h_g <- tau h_g + (1 - tau) avg(h_gi) (paper eq. 9 and "
                           "§IV-A3: 0.99; Table III also runs 0.9, 0.5, 0.2; 0 = plain FedAvg of the predictor)",
                     float, minimum=0, maximum=1),
        "extractor_epochs": Param(None, "[RECON] reconstructed: E1, step-1 epochs; the paper gives only '5 local update "
                                        "epochs' (§IV-A3); null = the cell's local_epochs (methods.md §1.2)",
                                  EPOCHS, minimum=0),
        "local_head_epochs": Param(None, "[RECON] reconstructed: E2, step-2 epochs of h_i, not stated in the paper; null = "
                                         "the cell's local_epochs (methods.md §1.2; a cheaper variant uses 1)",
                                   EPOCHS, minimum=0),
        "global_head_epochs": Param(None, "[RECON] reconstructed: E3, step-3 epochs of h_g, not stated in the paper; null = "
                                          "the cell's local_epochs (methods.md §1.2; a cheaper variant uses 1)",
                                    EPOCHS, minimum=0),
        "local_head_init": Param("global", "[RECON] reconstructed: h_i before a client's first participation, not stated in "
                                           "the paper: 'global' = a copy of the received h_g^t (methods.md §1.2), 'init' = the "
                                           "common seeded initial head. Also FedCRC-Per's head for a never-sampled client",
                                 str, choices=("global", "init")),
        "kl_temperature": Param(1.0, "[RECON] reconstructed: temperature T of the step-3 KL (softmaxes of logits / T, "
                                     "loss times T^2); the paper's eq. 6 has none, i.e. T = 1 (methods.md §1.2)",
                                float, exclusive_minimum=0),
        "kl_weight": Param(1.0, "[RECON] reconstructed: weight of the KL in step 3; eq. 7 adds it unweighted, i.e. 1 "
                                "(methods.md §1.2; 0 removes the local predictor's guidance)", float, minimum=0),
        "head_extractor": Param("received", "[RECON] reconstructed: the frozen extractor steps 2-3 train the heads on; "
                                            "'received' = the global f_g^t the client received (eqs. 5 and 7 write f_g, "
                                            "§III-B2 'using the fixed global representation extractor'); 'updated' = "
                                            "f_g' of step 1 (§III-C 'Subsequently, the extractor is used to train the local "
                                            "predictor', Fig. 2; the default before issue 35)",
                                str, choices=("received", "updated")),
        "cache_features": Param(True, "[RECON] reconstructed: steps 2-3 train the head on representations computed once "
                                      "(eval mode, no augmentation; methods.md §1.2 'features can be cached'); false = "
                                      "per-batch forward through the frozen extractor (augmented, train mode: BatchNorm "
                                      "running statistics, where a model keeps them, then still move)", bool),
        "weight_norm": Param("sampled", "[RECON] reconstructed: the N of eqs. 3 and 8, omega_g = sum_{i=1}^m |D_i| / N "
                                        "omega_i: 'sampled' = the m aggregated clients' samples, weights summing to 1 "
                                        "('performs model averaging aggregation', §III-A; methods.md §1.3); "
                                        "'all_clients' = eq. 1's N = sum_i |D_i| over all M clients of the federation, "
                                        "literally (the weights then sum to about the sampled fraction)",
                             str, choices=("sampled", "all_clients")),
    }

    @classmethod
    def cost_passes_for(cls, hp, training):
        # per local epoch: the extractor's epochs, then the two heads' epochs, on cached features (a forward
        # over the train split, then head steps) or through the frozen extractor (a forward a batch)
        epochs = training["local_epochs"]
        ext, local, glob = (epochs if hp[k] is None else hp[k] for k in ("extractor_epochs", "local_head_epochs",
                                                                          "global_head_epochs"))
        heads = local + glob
        if hp["cache_features"]:
            return Passes((ext + FORWARD_SHARE) / epochs, head=heads / epochs)
        return Passes((ext + heads * FORWARD_SHARE) / epochs)

    def setup(self):
        super().setup()
        self.server["init_head"] = self.engine.get_params(("head.",))

    # -- client ---------------------------------------------------------------------
    def local_update(self, client, payload):
        eng = self.engine
        h_i = self.local_head(client, payload)
        eng.set_params(payload)
        fit = self.train_extractor(client)  # step 1
        f_new, h_g = eng.get_params(("extractor.",)), eng.get_params(("head.",))  # f_g'; h_g^t: step 1 froze it
        if self.hp["head_extractor"] == "received":
            eng.set_params(select(payload, ("extractor.",)))  # steps 2-3 on f_g^t (eq. 5)
        z = eng.features(client.train.x) if self.hp["cache_features"] else None
        client.state["head"] = self.train_head(client, "local", h_i, z, ce)  # step 2
        self.train_head(client, "global", h_g, z, self.global_head_loss(client.state["head"]))  # step 3
        eng.set_params(f_new)
        return Update(client.id, client.num_train, eng.get_params(), loss=fit.loss)  # f_g' + h_gi; h_i stays

    def train_extractor(self, client):
        return self.engine.fit(client, epochs=self.hp["extractor_epochs"], trainable=("extractor.",))

    def train_head(self, client, which: str, start: Params, z, loss) -> Params:
        """Train the head from `start` for the `which`_head_epochs on `loss(logits, z, y)`,
        the extractor frozen (on the cached representations `z` unless None); return it."""
        eng, epochs = self.engine, self.hp[f"{which}_head_epochs"]
        eng.set_params(start)
        if z is None:
            eng.fit(client, epochs=epochs, trainable=("head.",), loss_fn=lambda b: loss(b.logits, b.features, b.y))
            return eng.get_params(("head.",))
        t = eng.training
        eng.fit_head(z, client.train.y, epochs=t["local_epochs"] if epochs is None else epochs, batch_size=t["batch_size"],
                     opt=eng.optimizer(eng.model.head.parameters()), g=eng.generator(f"fedcrc-{which}-head", eng.round, client.id),
                     loss_fn=loss, drop_last=t["drop_last"])
        return eng.get_params(("head.",))

    def global_head_loss(self, h_i: Params):
        """Step 3: CE(h_g(z), y) + w T^2 KL(softmax(h_i(z)/T) || softmax(h_g(z)/T)), batch mean, h_i detached."""
        head, w, T = self.engine.model.head, self.hp["kl_weight"], self.hp["kl_temperature"]
        teacher = {k[len("head."):]: v for k, v in h_i.items()}

        def loss(logits, z, y):
            with torch.no_grad():
                target = F.softmax(functional_call(head, teacher, (z,)) / T, dim=1)
            kl = F.kl_div(F.log_softmax(logits / T, dim=1), target, reduction="batchmean")
            return F.cross_entropy(logits, y) + w * T * T * kl

        return loss

    # -- server ---------------------------------------------------------------------
    def aggregate(self, updates):
        if not updates:
            return
        old, avg = self.server["global"], weighted_average(updates, total=self.weight_total())
        tau = self.hp["tau"]
        ema = {k: tau * old[k] + (1 - tau) * v for k, v in select(avg, ("head.",)).items() if v.is_floating_point()}
        self.server["global"] = {**old, **avg, **ema}

    def weight_total(self) -> float | None:
        """N of eqs. 3 and 8 (`weight_norm`): None = the aggregated clients' samples."""
        if self.hp["weight_norm"] == "sampled":
            return None
        return float(sum(c.num_train for c in self.engine.clients))

    # -- evaluation -------------------------------------------------------------------
    def local_head(self, client, global_params: Params) -> Params:
        """h_i; before the client's first participation, its `local_head_init` initialisation."""
        if "head" in client.state:
            return client.state["head"]
        return select(global_params, ("head.",)) if self.hp["local_head_init"] == "global" else self.server["init_head"]

    def personal_params(self, client):
        return {**self.server["global"], **self.local_head(client, self.server["global"])}


def ce(logits, z, y):
    return F.cross_entropy(logits, y)
