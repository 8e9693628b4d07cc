"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022).

Algorithm: only class prototypes travel; no model is ever aggregated.
  1. Client i trains its own full model (kept in client.state) on
     CE + lambda * MSE(f_i(x), C̄[y]), C̄ = the global prototypes (first round: CE only);
  2. it uploads C_i[c] = mean of f_i(x) over its training samples of class c (eval mode);
  3. the server sets C̄[c] = the mean of C_i[c] over the clients of the round that have c;
  4. inference: the class of the nearest global prototype, arg min_c ||f_i(x) - C̄[c]||^2.

Step 4 runs through the engine's argmax of logits: the personalized model's head is
replaced by weight 2 C̄, bias -||C̄[c]||^2, which is -||z - C̄[c]||^2 + ||z||^2 (the same
argmax; classes without a global prototype get bias -inf). See
`_prototypes.nearest_prototype_head`.

Choices (../shared/reference/methods.md §6, PFLlib clientproto/serverproto, FL-bench):
* Prototypes are averaged unweighted over clients (spec, the official code's
  proto_aggregation, PFLlib, FL-bench). The paper's aggregation formula carries a per-client
  sample-size factor with an ambiguous normalisation; `proto_weighting: samples` gives the
  sample-weighted mean.
* A class that no client of the round uploads keeps its last global prototype
  (`keep_missing: true`, default). PFLlib and FL-bench rebuild the prototypes from each
  round's uploads only, which under partial participation deletes the class: it is never
  predicted again until a client that has it is sampled (hidden in PFLlib by full
  participation, where every class is uploaded every round). `keep_missing: false` is theirs.
* Local prototypes are computed after training, in eval mode, over the whole train
  split (PFLlib's collect_protos; PFLlib's current clientproto averages the train-mode
  representations seen during training instead).
* No global model exists (extractors are private and never averaged, so an average of the
  clients' models is a model nobody trains): has_global = False.
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._prototypes import (aggregate_prototypes, alignment_loss, empty_prototypes, keep_missing, known_prototypes,
                          local_prototypes, nearest_prototype_head, require_linear_head, weighting_param)
from .base import FORWARD_SHARE, Method, Passes, Update


@register
class FedProto(Method):
    name = "fedproto"
    summary = "FedProto: only class prototypes travel; CE + lambda*MSE to global prototypes; nearest-prototype inference"
    paper = "Tan et al., AAAI 2022"
    hparams = {
        "lam": Param(1.0, "lambda: weight of MSE(representation, global prototype of its label) (PFLlib, FL-bench: 1.0)",
                     float, minimum=0),
        "proto_weighting": weighting_param("clients", "default 'clients' (official code, PFLlib, FL-bench, methods.md §6)"),
        "keep_missing": Param(True, "[RECON] a class no client of the round uploads keeps its last global prototype "
                                    "(false: rebuilt from the round's uploads only, as PFLlib / FL-bench, which loses the "
                                    "class under partial participation)", bool),
    }
    shared = ()  # no parameters travel: prototypes only
    has_global = False
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # after the local epochs, one forward over the train split for the uploaded prototypes
        return Passes(1 + FORWARD_SHARE / training["local_epochs"])

    def setup(self):
        require_linear_head(self.engine, self.name)
        self.server["init"] = self.engine.get_params()  # every client's model starts here
        self.server.update(empty_prototypes(self.engine.num_classes, self.engine.model.feature_dim, self.engine.device))

    def broadcast(self, client):
        return known_prototypes(self.server)

    def local_update(self, client, payload):
        eng = self.engine
        eng.set_params(client.state.get("model", self.server["init"]))
        fit = eng.fit(client, loss_fn=alignment_loss(payload, eng.num_classes, self.hp["lam"]))
        client.state["model"] = eng.get_params()
        protos = local_prototypes(eng, client, with_counts=self.hp["proto_weighting"] == "samples")
        return Update(client.id, client.num_train, extras=protos, loss=fit.loss)

    def aggregate(self, updates):
        eng = self.engine
        new = aggregate_prototypes([u.extras for u in updates], eng.num_classes, eng.model.feature_dim,
                                   self.hp["proto_weighting"], eng.device)
        self.server.update(keep_missing(self.server, new) if self.hp["keep_missing"] else new)

    def personal_params(self, client):
        model = client.state.get("model", self.server["init"])
        if not bool(self.server["present"].any()):  # no prototype yet: the model's own head
            return model
        return {**model, **nearest_prototype_head(self.server)}
