"""How the per-example site curvatures are held: dense, Gauss–Newton factors, sparse, diagonal, and the choice of
storage from the machine's memory.

The package namespace re-exports :mod:`numpyro_pc.curvature.stores`.
"""

from __future__ import annotations

from numpyro_pc.curvature import stores as _stores
from numpyro_pc.curvature.stores import *  # noqa: F401,F403
from numpyro_pc.curvature.stores import __getattr__ as _stores_getattr

__all__ = list(_stores.__all__)


def __getattr__(name: str) -> type:
    if name == "Factor":  # renamed, with a FutureWarning naming the caller's line
        return _stores_getattr(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
