"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv
1912.00818, 2019).

Algorithm: each sampled client loads the global extractor ("base layers") under its own
head ("personalization layers"), trains both jointly for E local epochs on cross-entropy,
keeps the head and uploads only the extractor; the server FedAvg-averages the extractors.
Personalized model = global extractor + the client's own head. No global model exists:
the "(global)" column is the sample-weighted average of the personalized models, heads
included (FedCRC Table II convention, methods.md §1.6). PFLlib `clientper.py`; no
method-specific hyper-parameters (methods.md §6).
"""

from __future__ import annotations

from . import register
from ._partial import PartialSharing


@register
class FedPer(PartialSharing):
    name = "fedper"
    summary = "FedPer: extractor averaged by FedAvg, head kept by each client; joint local training"
    paper = "Arivazhagan et al., arXiv:1912.00818, 2019"
    shared = ("extractor.",)
    vectorized = True
