"""numpyro_pc — keep a fitted NumPyro posterior alive with Khan's posterior correction.

A fitted Gaussian guide becomes a :class:`DualPosterior`: the posterior written as a
product of one cached site per example plus a prior site (paper eq. ``qdualform``).

The package never enables 64-bit mode globally; use ``jax.config.update("jax_enable_x64",
True)`` or the scoped ``jax.enable_x64()`` where exactness matters.
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.machinery as _importlib_machinery
import importlib.util as _importlib_util
import sys as _sys
import types as _types
from importlib import metadata as _metadata

from numpyro_pc import errors, families, guides
from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.dual.expfam import EFPosterior
from numpyro_pc.errors import (
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
    UnknownExampleError,
    UnsupportedGuideError,
    UnsupportedModelError,
)
from numpyro_pc.families import lowrank
from numpyro_pc.families.lowrank import LowRankGaussian
from numpyro_pc.families.product import register_factor
from numpyro_pc.families.registry import (DiagonalGaussian, FullGaussian, Gaussian, GaussianNatural, IsotropicGaussian,
                                          get_family)
from numpyro_pc.io.save_load import save
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.ops import diagnostics, handlers
from numpyro_pc.ops.diagnostics import correction_magnitude, information_gain, kl
from numpyro_pc.posterior import DualPosterior, Posterior, boost, change_prior, dual_form, fit, load
from numpyro_pc.options import SolverOptions
from numpyro_pc.sites.expectations import ExpectationRule
from numpyro_pc.sites.gaussian import Sites, compute_sites

try:  # the installed distribution's version, so the two cannot disagree
    __version__ = _metadata.version("numpyro-pc")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "Posterior", "DualPosterior", "EFPosterior", "dual_form", "fit", "boost", "change_prior", "compute_sites", "bind_model", "Sites", "ExpectationRule",
    "SolverOptions",
    "Gaussian", "GaussianNatural", "FullGaussian", "DiagonalGaussian", "IsotropicGaussian", "LowRankGaussian",
    "get_family", "register_factor", "errors", "families", "guides", "handlers", "lowrank", "diagnostics", "kl",
    "information_gain",
    "correction_magnitude", "load", "save",
    "PosteriorCorrectionError", "UnsupportedGuideError", "GuideParamsError", "UnsupportedModelError",
    "DataShapeError", "DataSupportError", "DataTypeError", "NonFiniteDataError", "NonFiniteResultError", "NotPositiveDefiniteError",
    "ConvergenceError", "ExpectationRuleError", "SiteStorageError", "UnknownExampleError", "ModelMismatchError",
    "PersistenceError",
]

from numpyro_pc import federated  # noqa: E402
from numpyro_pc.ops import merging  # noqa: E402
from numpyro_pc.errors import (ClientMessageError, IncompatiblePosteriorsError, PrivacyError,  # noqa: E402
                               SuspectClientsError, TooFewClientsError, TransportError, TransportSecurityError)
from numpyro_pc.ops.merging import merge  # noqa: E402

__all__ += ["merge", "merging", "federated", "IncompatiblePosteriorsError", "ClientMessageError", "PrivacyError", "SuspectClientsError",
            "TooFewClientsError", "TransportError", "TransportSecurityError"]

from numpyro_pc import criticism  # noqa: E402
from numpyro_pc.criticism import influence, lfo, loo  # noqa: E402

__all__ += ["criticism", "loo", "lfo", "influence"]

from numpyro_pc.compilation_cache import (compilation_cache_dir, disable_compilation_cache,  # noqa: E402
                                          enable_compilation_cache)
from numpyro_pc.compilation_cache import enable_by_default as _enable_compilation_cache_by_default  # noqa: E402

__all__ += ["enable_compilation_cache", "disable_compilation_cache", "compilation_cache_dir"]

_enable_compilation_cache_by_default()  # JAX's persistent cache in a per-user folder (numpyro_pc.compilation_cache)


#: modules of the flat layout (release 0.1) and where they live now; the old names import for one
#: release with a FutureWarning (the packages that took a module's name re-export its API instead)
MOVED_MODULES = {
    "numpyro_pc.archive": "numpyro_pc.io.archive",
    "numpyro_pc.batches": "numpyro_pc.model.batches",
    "numpyro_pc.boundary": "numpyro_pc.solvers.boundary",
    "numpyro_pc.cached_sites": "numpyro_pc.sites.cached",
    "numpyro_pc.capabilities": "numpyro_pc.protocols.capabilities",
    "numpyro_pc.correction": "numpyro_pc.ops.correction",
    "numpyro_pc.curvature_sparse": "numpyro_pc.curvature.sparse",
    "numpyro_pc.data_support": "numpyro_pc.model.data_support",
    "numpyro_pc.dual_build": "numpyro_pc.dual.build",
    "numpyro_pc.ef_adapt": "numpyro_pc.dual.expfam_adapt",
    "numpyro_pc.ef_demo": "numpyro_pc.demos.expfam",
    "numpyro_pc.ef_discrete": "numpyro_pc.families.discrete",
    "numpyro_pc.ef_eval": "numpyro_pc.sites.expfam_eval",
    "numpyro_pc.ef_families": "numpyro_pc.families.expfam",
    "numpyro_pc.ef_fit": "numpyro_pc.dual.expfam_fit",
    "numpyro_pc.ef_gaussian": "numpyro_pc.families.expfam_gaussian",
    "numpyro_pc.ef_guides": "numpyro_pc.guides.expfam",
    "numpyro_pc.ef_handlers": "numpyro_pc.ops.expfam_handlers",
    "numpyro_pc.ef_io": "numpyro_pc.io.expfam",
    "numpyro_pc.ef_posterior": "numpyro_pc.dual.expfam",
    "numpyro_pc.ef_product": "numpyro_pc.families.product",
    "numpyro_pc.ef_rules": "numpyro_pc.families.point_sets",
    "numpyro_pc.ef_site_table": "numpyro_pc.sites.expfam_table",
    "numpyro_pc.ef_sites": "numpyro_pc.sites.expfam",
    "numpyro_pc.ef_solve": "numpyro_pc.solvers.expfam",
    "numpyro_pc.expectations": "numpyro_pc.sites.expectations",
    "numpyro_pc.family_protocol": "numpyro_pc.protocols.family",
    "numpyro_pc.federated.demo": "numpyro_pc.demos.federated",
    "numpyro_pc.file_format": "numpyro_pc.io.file_format",
    "numpyro_pc.fingerprint": "numpyro_pc.io.fingerprint",
    "numpyro_pc.fixed_point": "numpyro_pc.solvers.fixed_point",
    "numpyro_pc.gaussians": "numpyro_pc.families.gaussians",
    "numpyro_pc.gp.demo": "numpyro_pc.demos.gp",
    "numpyro_pc.hierarchical": "numpyro_pc.posteriordb.suite",
    "numpyro_pc.latent": "numpyro_pc.model.latent",
    "numpyro_pc.likelihood": "numpyro_pc.model.likelihood",
    "numpyro_pc.lowrank_algebra": "numpyro_pc.families.lowrank_algebra",
    "numpyro_pc.memory": "numpyro_pc.curvature.memory",
    "numpyro_pc.memory_sets": "numpyro_pc.sites.memory_sets",
    "numpyro_pc.model_terms": "numpyro_pc.model.terms",
    "numpyro_pc.newton_polish": "numpyro_pc.solvers.newton_polish",
    "numpyro_pc.plotting": "numpyro_pc.demos.plotting",
    "numpyro_pc.posterior_protocol": "numpyro_pc.protocols.posterior",
    "numpyro_pc.posterior_state": "numpyro_pc.dual.state",
    "numpyro_pc.posteriordb_base": "numpyro_pc.posteriordb.base",
    "numpyro_pc.posteriordb_hierarchical": "numpyro_pc.posteriordb.hierarchical",
    "numpyro_pc.prior_site": "numpyro_pc.sites.prior",
    "numpyro_pc.rowops": "numpyro_pc.model.rows",
    "numpyro_pc.rows": "numpyro_pc.model.rows",
    "numpyro_pc.saved_model": "numpyro_pc.io.saved_model",
    "numpyro_pc.site_problem": "numpyro_pc.solvers.site_problem",
    "numpyro_pc.site_protocol": "numpyro_pc.protocols.sites",
    "numpyro_pc.site_storage": "numpyro_pc.curvature.storage",
    "numpyro_pc.site_table": "numpyro_pc.kernels.site_table",
    "numpyro_pc.site_table_sag": "numpyro_pc.kernels.site_table_sag",
    "numpyro_pc.start": "numpyro_pc.solvers.start",
    "numpyro_pc.stochastic": "numpyro_pc.ops.stochastic",
    "numpyro_pc.stream_state": "numpyro_pc.kernels.stream_state",
    "numpyro_pc.streaming": "numpyro_pc.ops.streaming",
    "numpyro_pc.unlearning": "numpyro_pc.ops.unlearning",
    "numpyro_pc.validation": "numpyro_pc.io.validation",
}


#: modules of the flat layout that stay public names of the package (``pc.handlers`` …): importing them
#: under the old name is not deprecated
KEPT_MODULE_NAMES = {
    "numpyro_pc.diagnostics": "numpyro_pc.ops.diagnostics",
    "numpyro_pc.handlers": "numpyro_pc.ops.handlers",
    "numpyro_pc.lowrank": "numpyro_pc.families.lowrank",
    "numpyro_pc.merging": "numpyro_pc.ops.merging",
}


class _MovedModuleFinder(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Imports a module of the flat layout under its old name: the same module object (so that
    patching either name patches both), with a ``FutureWarning`` that names the new one (none for
    :data:`KEPT_MODULE_NAMES`)."""

    def find_spec(self, fullname: str, path=None, target=None) -> _importlib_machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES and fullname not in KEPT_MODULE_NAMES:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec: _importlib_machinery.ModuleSpec) -> _types.ModuleType:
        new = MOVED_MODULES.get(spec.name) or KEPT_MODULE_NAMES[spec.name]
        if spec.name in MOVED_MODULES:
            warn_renamed(f"{spec.name} moved to {new}; the old name will be removed in the next release")
        module = _importlib.import_module(new)
        spec.loader_state = module.__spec__  # per import, so that concurrent imports cannot swap them
        return module

    def exec_module(self, module: _types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # type: ignore[union-attr]  # the alias's spec, set by the machinery


def __getattr__(name: str) -> _types.ModuleType:
    """``pc.<module of the flat layout>`` (``pc.likelihood``, ``pc.ef_sites`` …): the module, imported
    under its old name (with the finder's ``FutureWarning``)."""
    old = f"numpyro_pc.{name}"
    if old in MOVED_MODULES:
        return _importlib.import_module(old)
    raise AttributeError(f"module 'numpyro_pc' has no attribute {name!r}")


if not any(isinstance(finder, _MovedModuleFinder) for finder in _sys.meta_path):
    _sys.meta_path.append(_MovedModuleFinder())
