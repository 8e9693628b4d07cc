"""pFL-MoCo v2 (Calibre's baseline, Plato examples/ssl): federated mocov2 with FedAvg, then a linear
probe per client on the frozen encoder (Chen et al., arXiv:2003.04297 (2020)). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLMoCoV2 = register(pfl_ssl("mocov2", name="pfl_mocov2", paper="Chen et al., arXiv:2003.04297 (2020) + Calibre's personalization (Chen et al. 2024)"))
