"""The dual-form posterior's state and classes (below the operations): the Gaussian base class and its builder,
the exponential-family posterior with its fit and adaptations.

The package namespace re-exports :mod:`numpyro_pc.dual.base`. It also answers, for one release and
with a ``FutureWarning``, the names that moved between its modules: ``numpyro_pc.dual.build_posterior``
(now :func:`numpyro_pc.dual.build.build_posterior`) and ``fit_ef``/``dual_form_ef`` of the
exponential-family posterior's module (now in :mod:`numpyro_pc.dual.expfam_fit`).
"""


from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.dual import base as _base
from numpyro_pc.dual import build as _build
from numpyro_pc.dual import expfam as _expfam
from numpyro_pc.dual import expfam_fit as _expfam_fit
from numpyro_pc.dual.base import *  # noqa: F401,F403

__all__ = list(_base.__all__)


def _moved(old: str, new: str, value):
    warn_renamed(f"{old} moved to {new}; the old location is removed in the next release")
    return value


def __getattr__(name: str):
    if name == "build_posterior":
        return _moved("numpyro_pc.dual.build_posterior", "numpyro_pc.dual.build.build_posterior",
                      _build.build_posterior)
    raise AttributeError(f"module 'numpyro_pc.dual' has no attribute {name!r}")


def _expfam_getattr(name: str):
    if name in ("fit_ef", "dual_form_ef"):
        return _moved(f"numpyro_pc.ef_posterior.{name}", f"numpyro_pc.dual.expfam_fit.{name} (or call pc.fit / "
                      "pc.dual_form)", getattr(_expfam_fit, name))
    raise AttributeError(f"module 'numpyro_pc.dual.expfam' has no attribute {name!r}")


# the module cannot import its own fit (which builds on it); the package, above both, answers for it
_expfam.__getattr__ = _expfam_getattr
