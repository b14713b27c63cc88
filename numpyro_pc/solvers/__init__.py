"""The fixed-point engine (:mod:`numpyro_pc.solvers.fixed_point`: Anderson, damping, budgets, stagnation) and the
solves built on it: the Gaussian site problem and its host driver, the Newton polish, the starts, the
exponential-family natural-gradient solve.

The package namespace re-exports :mod:`numpyro_pc.solvers.gaussian`.
"""

from __future__ import annotations


from numpyro_pc.sites import expfam as _sites_expfam
from numpyro_pc.solvers import expfam as _expfam
from numpyro_pc.solvers import gaussian as _gaussian
from numpyro_pc.solvers.gaussian import *  # noqa: F401,F403
from numpyro_pc.deprecation import warn_renamed

__all__ = list(_gaussian.__all__)

_MOVED_FROM_SITES = ("blr_solve", "SolveInfo", "relative_residual", "EF_MAX_ITERS")


def _sites_expfam_getattr(name: str) -> object:
    if name in _MOVED_FROM_SITES:
        warn_renamed(f"numpyro_pc.ef_sites.{name} moved to numpyro_pc.solvers.expfam.{name}; the old location is "
                     "removed in the next release")
        return getattr(_expfam, name)
    raise AttributeError(f"module 'numpyro_pc.sites.expfam' has no attribute {name!r}")


# the solve moved up a layer (it builds on the sites); the package above both answers for its old place
_sites_expfam.__getattr__ = _sites_expfam_getattr  # type: ignore[method-assign]
