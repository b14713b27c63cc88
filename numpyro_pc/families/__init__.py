"""Exponential families over the latent ``z``: the Gaussian families (full, diagonal, isotropic, low-rank) and
the constrained ones (Beta, Gamma, Dirichlet, discrete factors, products), one module per kind.

A new family is one module here plus its registration (docs/architecture.md). The package namespace re-exports
the Gaussian registry (:mod:`numpyro_pc.families.registry`).
"""

from __future__ import annotations

from numpyro_pc.families import registry as _registry
from numpyro_pc.families.registry import *  # noqa: F401,F403

__all__ = list(_registry.__all__)


def __getattr__(name: str) -> type:
    if name == "ExponentialFamily":
        return _registry.__getattr__(name)  # renamed: warns there, naming GaussianFamily
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
