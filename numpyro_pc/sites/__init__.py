"""The cached sites of a dual-form posterior and how they are computed: the Gaussian sites with their expectation
rules and prior site, the exponential-family sites and their table, and the rule for which sites an update
corrects.

The package namespace re-exports :mod:`numpyro_pc.sites.gaussian`.
"""

from __future__ import annotations

from numpyro_pc.sites import gaussian as _gaussian
from numpyro_pc.sites.gaussian import *  # noqa: F401,F403

__all__ = list(_gaussian.__all__)
