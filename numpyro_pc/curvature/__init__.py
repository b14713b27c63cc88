"""How the per-example site curvatures are held: dense, Gauss–Newton factors, sparse, diagonal, and the choice of
storage from the machine's memory.

The package namespace re-exports :mod:`numpyro_pc.curvature.stores`.
"""

from __future__ import annotations

from numpyro_pc.curvature import stores as _stores
from numpyro_pc.curvature.stores import *  # noqa: F401,F403
from numpyro_pc.curvature.stores import __getattr__  # noqa: F401  (names renamed, with a FutureWarning)

__all__ = list(_stores.__all__)
