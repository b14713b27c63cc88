"""How the per-example site curvatures are held: dense, Gauss–Newton factors, sparse, diagonal, and the choice of
storage from the machine's memory.

The package namespace re-exports :mod:`numpyro_pc.curvature.stores`.
"""

from __future__ import annotations

import warnings as _warnings

from numpyro_pc.curvature import stores as _stores
from numpyro_pc.curvature.stores import *  # noqa: F401,F403

__all__ = list(_stores.__all__)


def __getattr__(name: str) -> type:
    # warned here rather than through stores.__getattr__ (stacklevel=2 there is this frame): the warning names
    # the caller's line; same text as stores.__getattr__'s (tests/test_package_layout.py compares them)
    if name == "Factor":  # renamed, with a FutureWarning
        _warnings.warn("numpyro_pc.curvature.Factor is now JacobianFactor (the store of H_i = J_i^T Lambda_i J_i; "
                       "Factor is the exponential-family factor of numpyro_pc.families.expfam); the old name will be "
                       "removed in the next release", FutureWarning, stacklevel=2)
        return _stores.JacobianFactor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
