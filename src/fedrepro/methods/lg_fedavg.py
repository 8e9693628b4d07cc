"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", arXiv 2001.01523, 2020).

Algorithm, the inverse split of FedPer: each sampled client puts the global head (the
"global model" on top) over its own extractor (the "local representation"), trains both
jointly for E local epochs on cross-entropy, keeps the extractor and uploads only the
head; the server FedAvg-averages the heads. Personalized model = the client's own
extractor + the global head.

Choices (methods.md §6): the global part is the model's head (its last linear layer), as
in PFLlib `clientlg.py`; the paper may share several top layers, and starts from a
FedAvg-pretrained model, which is not done here. The paper's "new device" test ensembles
the outputs of all local models (also asked for GRP-FED's global test); an output
ensemble is not a single parameter set, so the "(global)" column here is the
sample-weighted average of the personalized models (FedCRC Table II convention, methods.md
§1.6), as for FedPer and FedRep. No method-specific hyper-parameters.
"""

from __future__ import annotations

from . import register
from ._partial import PartialSharing


@register
class LGFedAvg(PartialSharing):
    name = "lg_fedavg"
    summary = "LG-FedAvg: head averaged by FedAvg, extractor kept by each client; joint local training"
    paper = "Liang et al., arXiv:2001.01523, 2020"
    shared = ("head.",)
    vectorized = True
