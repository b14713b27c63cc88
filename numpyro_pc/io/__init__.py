"""Saving and loading posteriors: the versioned file format, bounded archive reading, validation, model
fingerprints and signatures.

The package namespace re-exports :mod:`numpyro_pc.io.save_load` (``save``, ``load``).
"""

from numpyro_pc.io import save_load as _save_load
from numpyro_pc.io.save_load import *  # noqa: F401,F403

__all__ = list(_save_load.__all__)
