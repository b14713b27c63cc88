"""Data sets shipped with or read by the package (a7a, UCI regressions, Bui's data, breast cancer); nothing here
imports the library.

The package namespace re-exports :mod:`numpyro_pc.datasets.loaders`.
"""

from __future__ import annotations

from numpyro_pc.datasets import loaders as _loaders
from numpyro_pc.datasets.loaders import *  # noqa: F401,F403

__all__ = list(_loaders.__all__)
