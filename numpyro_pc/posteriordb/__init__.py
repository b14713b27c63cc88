"""posteriordb models translated to NumPyro with their reference posteriors, and the hierarchical suite.

The package namespace re-exports :mod:`numpyro_pc.posteriordb.reference`.
"""

from __future__ import annotations

import warnings as _warnings

from numpyro_pc.posteriordb import reference as _reference
from numpyro_pc.posteriordb.reference import *  # noqa: F401,F403

__all__ = list(_reference.__all__)


def __getattr__(name: str) -> type:
    # warned here rather than through reference.__getattr__ (stacklevel=2 there is this frame): the warning names
    # the caller's line; same text as reference.__getattr__'s (tests/test_package_layout.py compares them)
    if name == "Posterior":  # renamed, with a FutureWarning
        _warnings.warn("numpyro_pc.posteriordb.Posterior is now ReferencePosterior (numpyro_pc.Posterior is the "
                       "fitted dual-form posterior); the old name will be removed in the next release",
                       FutureWarning, stacklevel=2)
        return _reference.ReferencePosterior
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
