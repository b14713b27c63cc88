"""Binding a NumPyro model: its latent space, its per-example losses over the data plate, the data checks, and
row bookkeeping.

Everything above reads a model through :mod:`numpyro_pc.model.likelihood`.
"""

from __future__ import annotations
