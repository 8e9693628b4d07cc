"""pFL-SimSiam (Calibre's baseline, Plato examples/ssl): federated simsiam with FedAvg, then a linear
probe per client on the frozen encoder (Chen and He, CVPR 2021). The family: _ssl.py; the objective:
fedrepro.ssl.objectives."""

from __future__ import annotations

from . import register
from ._ssl import pfl_ssl

PFLSimSiam = register(pfl_ssl("simsiam", name="pfl_simsiam", paper="Chen and He, CVPR 2021 + Calibre's personalization (Chen et al. 2024)"))
