"""pFL-SMoG (Calibre's baseline, Plato examples/ssl): federated smog with FedAvg, then a linear
probe per client on the frozen encoder (Pang et al., ECCV 2022). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLSMoG = register(pfl_ssl("smog", name="pfl_smog", paper="Pang et al., ECCV 2022 + Calibre's personalization (Chen et al. 2024)"))
