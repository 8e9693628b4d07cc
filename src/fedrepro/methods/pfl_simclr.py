"""pFL-SimCLR (Calibre's baseline, Plato examples/ssl): federated simclr with FedAvg, then a linear
probe per client on the frozen encoder (Chen et al., ICML 2020). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLSimCLR = register(pfl_ssl("simclr", name="pfl_simclr", paper="Chen et al., ICML 2020 + Calibre's personalization (Chen et al. 2024)"))
