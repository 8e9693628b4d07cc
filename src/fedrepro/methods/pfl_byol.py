"""pFL-BYOL (Calibre's baseline, Plato examples/ssl): federated byol with FedAvg, then a linear
probe per client on the frozen encoder (Grill et al., NeurIPS 2020). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLBYOL = register(pfl_ssl("byol", name="pfl_byol", paper="Grill et al., NeurIPS 2020 + Calibre's personalization (Chen et al. 2024)"))
