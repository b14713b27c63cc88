"""The fixed-point engine (:mod:`numpyro_pc.solvers.fixed_point`: Anderson, damping, budgets, stagnation) and the
solves built on it: the Gaussian site problem and its host driver, the Newton polish, the starts, the
exponential-family natural-gradient solve.

The package namespace re-exports :mod:`numpyro_pc.solvers.gaussian`.
"""

from __future__ import annotations

from numpyro_pc.solvers import gaussian as _gaussian
from numpyro_pc.solvers.gaussian import *  # noqa: F401,F403

__all__ = list(_gaussian.__all__)
