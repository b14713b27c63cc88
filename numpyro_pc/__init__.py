"""numpyro_pc — keep a fitted NumPyro posterior alive with Khan's posterior correction.

A fitted Gaussian guide becomes a :class:`DualPosterior`: the posterior written as a
product of one cached site per example plus a prior site (paper eq. ``qdualform``).

The package never enables 64-bit mode globally; use ``jax.config.update("jax_enable_x64",
True)`` or the scoped ``jax.enable_x64()`` where exactness matters.
"""

from importlib import metadata as _metadata

from . import diagnostics, errors, families, guides, handlers, lowrank
from .errors import (
    ConvergenceError,
    DataShapeError,
    DataSupportError,
    DataTypeError,
    ExpectationRuleError,
    GuideParamsError,
    ModelMismatchError,
    NonFiniteDataError,
    NonFiniteResultError,
    NotPositiveDefiniteError,
    PersistenceError,
    PosteriorCorrectionError,
    SiteStorageError,
    UnsupportedGuideError,
    UnknownExampleError,
    UnsupportedModelError,
)
from .expectations import ExpectationRule
from .families import DiagonalGaussian, FullGaussian, Gaussian, GaussianNatural, IsotropicGaussian, get_family
from .likelihood import bind_model
from .ef_posterior import EFPosterior
from .ef_product import register_factor
from .lowrank import LowRankGaussian
from .posterior import DualPosterior, Posterior, dual_form, fit, load
from .io import save
from .sites import Sites, compute_sites
from .diagnostics import correction_magnitude, information_gain, kl

try:  # the installed distribution's version, so the two cannot disagree
    __version__ = _metadata.version("numpyro-pc")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "Posterior", "DualPosterior", "EFPosterior", "dual_form", "fit", "compute_sites", "bind_model", "Sites", "ExpectationRule",
    "Gaussian", "GaussianNatural", "FullGaussian", "DiagonalGaussian", "IsotropicGaussian", "LowRankGaussian",
    "get_family", "register_factor", "errors", "families", "guides", "handlers", "lowrank", "diagnostics", "kl",
    "information_gain",
    "correction_magnitude", "load", "save",
    "PosteriorCorrectionError", "UnsupportedGuideError", "GuideParamsError", "UnsupportedModelError",
    "DataShapeError", "DataSupportError", "DataTypeError", "NonFiniteDataError", "NonFiniteResultError", "NotPositiveDefiniteError",
    "ConvergenceError", "ExpectationRuleError", "SiteStorageError", "UnknownExampleError", "ModelMismatchError",
    "PersistenceError",
]

from . import federated, merging  # noqa: E402
from .errors import ClientMessageError, IncompatiblePosteriorsError, PrivacyError, TooFewClientsError  # noqa: E402
from .merging import merge  # noqa: E402

__all__ += ["merge", "merging", "federated", "IncompatiblePosteriorsError", "ClientMessageError", "PrivacyError", "TooFewClientsError"]

from . import criticism  # noqa: E402
from .criticism import influence, lfo, loo  # noqa: E402

__all__ += ["criticism", "loo", "lfo", "influence"]

from .compilation_cache import (compilation_cache_dir, disable_compilation_cache,  # noqa: E402
                                enable_compilation_cache)
from .compilation_cache import enable_by_default as _enable_compilation_cache_by_default  # noqa: E402

__all__ += ["enable_compilation_cache", "disable_compilation_cache", "compilation_cache_dir"]

_enable_compilation_cache_by_default()  # JAX's persistent cache in a per-user folder (numpyro_pc.compilation_cache)
