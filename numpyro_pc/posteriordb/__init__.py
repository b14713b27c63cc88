"""posteriordb models translated to NumPyro with their reference posteriors, and the hierarchical suite.

The package namespace re-exports :mod:`numpyro_pc.posteriordb.reference`.
"""

from __future__ import annotations

from numpyro_pc.posteriordb import reference as _reference
from numpyro_pc.posteriordb.reference import *  # noqa: F401,F403
from numpyro_pc.posteriordb.reference import __getattr__  # noqa: F401  (names moved or renamed, with a FutureWarning)

__all__ = list(_reference.__all__)
