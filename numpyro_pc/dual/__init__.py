"""The dual-form posterior's state and classes (below the operations): the Gaussian base class and its builder,
the exponential-family posterior with its fit and adaptations.

The package namespace re-exports :mod:`numpyro_pc.dual.base`.
"""

from numpyro_pc.dual import base as _base
from numpyro_pc.dual.base import *  # noqa: F401,F403
from numpyro_pc.dual.base import __getattr__  # noqa: F401  (names moved or renamed, with a FutureWarning)

__all__ = list(_base.__all__)
