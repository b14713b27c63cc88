"""Saving and loading posteriors: the versioned file format, bounded archive reading, validation, model
fingerprints and signatures.

The package namespace re-exports :mod:`numpyro_pc.io.save_load` (``save``, ``load``). It also
answers, for one release and with a ``FutureWarning``, the flat layout's
``numpyro_pc.validation.check_manifest``, replaced by :func:`numpyro_pc.io.file_format.check_manifest`.
"""



from numpyro_pc.io import file_format as _file_format
from numpyro_pc.io import save_load as _save_load
from numpyro_pc.io import validation as _validation
from numpyro_pc.io.save_load import *  # noqa: F401,F403
from numpyro_pc.deprecation import warn_renamed

__all__ = list(_save_load.__all__)


def _validation_getattr(name: str):
    if name == "check_manifest":
        warn_renamed("numpyro_pc.validation.check_manifest was replaced by numpyro_pc.io.file_format.check_manifest, "
                     "which checks a version-2 manifest of either kind (numpyro_pc.io.file_format.upgrade maps a "
                     "version-1 manifest to it); the old name is removed in the next release")
        return _file_format.check_manifest
    raise AttributeError(f"module 'numpyro_pc.io.validation' has no attribute {name!r}")


# validation cannot import the file format (which builds on it); the package, above both, answers for it
_validation.__getattr__ = _validation_getattr
