"""posteriordb models translated to NumPyro with their reference posteriors, and the hierarchical suite.

The package namespace re-exports :mod:`numpyro_pc.posteriordb.reference`.
"""

from __future__ import annotations

from numpyro_pc.posteriordb import reference as _reference
from numpyro_pc.posteriordb.reference import *  # noqa: F401,F403
from numpyro_pc.posteriordb.reference import __getattr__ as _reference_getattr

__all__ = list(_reference.__all__)


def __getattr__(name: str) -> type:
    if name == "Posterior":  # renamed, with a FutureWarning naming the caller's line
        return _reference_getattr(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
