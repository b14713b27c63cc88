"""Reading a fitted NumPyro guide as a member of a family: the Gaussian autoguides and the exponential-family
guides.

The package namespace re-exports :mod:`numpyro_pc.guides.gaussian`.
"""

from __future__ import annotations

from numpyro_pc.guides import gaussian as _gaussian
from numpyro_pc.guides.gaussian import *  # noqa: F401,F403

__all__ = list(_gaussian.__all__)
