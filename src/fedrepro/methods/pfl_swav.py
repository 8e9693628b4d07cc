"""pFL-SwAV (Calibre's baseline, Plato examples/ssl): federated swav with FedAvg, then a linear
probe per client on the frozen encoder (Caron et al., NeurIPS 2020). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLSwAV = register(pfl_ssl("swav", name="pfl_swav", paper="Caron et al., NeurIPS 2020 + Calibre's personalization (Chen et al. 2024)"))
