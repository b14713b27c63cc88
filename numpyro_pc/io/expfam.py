r"""Saving and loading an exponential-family :class:`~numpyro_pc.dual.expfam.EFPosterior`.

The file is the one format of :mod:`numpyro_pc.io.file_format` (one uncompressed zip of
``.npy`` members and a ``manifest.json``, written atomically, read with bounds, optionally
signed with an HMAC key), of kind ``"ef"``. Beside the common header its manifest records
``family`` (``{latent site: family name}`` in the model's latent order) and, in
``manifest["ef"]``, the site computation's ``config`` (``rule``, ``num_nodes``,
``num_samples``, ``seed``), ``conjugate_prior`` and ``next_id``. Its arrays are ``natural``
:math:`\lambda` ``(P,)``, the ids of deleted examples ``tombstones`` ``(K,)`` (``int64``), the site table's ``sites.grads`` (the sites :math:`g_i`,
``(N, P)``), ``sites.prior`` (:math:`g_0`, ``(P,)``) and ``sites.ids`` ``(N,)``, and the data
rows — every example's, or, when an update dropped data (``keep=``), those of the ids in ``data_ids``
``(R,)``, an array written only then, so that other files stay as before; the dual-form residual is
:math:`\|\lambda + g_0 + \sum_i g_i\| / (1 + \|g_0 + \sum_i g_i\|)`.

:func:`numpyro_pc.io.save_load.save` and :func:`numpyro_pc.io.save_load.load` dispatch here. Loading treats
the file as untrusted (:mod:`numpyro_pc.io.validation` checks the manifest and arrays),
binds the model and compares its fingerprint, rebuilds the family from the names with
:func:`~numpyro_pc.dual.expfam.family_for_model`, and checks that the arrays have the
family's size, that :math:`\lambda` is inside the family's domain, that the dual-form
residual recomputed from the arrays is the one recorded (:math:`\lambda = -g_0 - \sum_i g_i`
is what updates and deletions rely on), and, for a conjugate-form prior, that
:math:`-g_0` is the model's prior (:math:`\log p_0(x) - \langle -g_0, T(x)\rangle` constant
over draws). The hand-written guide a posterior was read from is code and is not saved:
pass it to :meth:`~numpyro_pc.dual.expfam.EFPosterior.to_guide_params` after loading.
"""

from __future__ import annotations

import math
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.expfam import EFConfig, EFPosterior, EFState, family_for_model
from numpyro_pc.errors import InconsistentFileError, PosteriorCorrectionError, SavedModelMismatchError
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.model.rows import to_device
from numpyro_pc.protocols.records import LoadInfo
from numpyro_pc.sites.expfam_eval import factor_prior_loss
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.deprecation import warn_renamed

from .file_format import build_manifest, check_file
from .file_format import check_manifest as _check_manifest
from .fingerprint import model_fingerprint
from .saved_model import bind_saved_model, binding_manifest, site_arrays, with_data_arrays, write_checked
from .validation import DATA_DTYPES, TOMBSTONES, check_residual, read_tombstones, tombstones_member
from .validation import check_ef_contents as _check_ef_contents

__all__ = ["KIND", "save_ef", "load_ef"]

KIND = "ef"
_PRIOR_PROBES = 8  # draws at which a conjugate-form prior is compared with the model's
# former checks of this module -> (their replacement, what it checks)
_REPLACED = {
    "check_ef_manifest": ("numpyro_pc.io.file_format.check_manifest", _check_manifest,
                          "a version-2 manifest of either kind; numpyro_pc.io.file_format.upgrade maps a version-1 "
                          "manifest to it"),
    "check_ef_contents": ("numpyro_pc.io.validation.check_ef_contents", _check_ef_contents,
                          "the arrays of a version-2 'ef' file, named sites.grads, sites.prior and sites.ids"),
}


def __getattr__(name: str) -> Callable[..., Any]:
    """The checks that moved to :mod:`numpyro_pc.io.file_format` and :mod:`numpyro_pc.io.validation`
    (``check_ef_manifest``, ``check_ef_contents``): importing them from here still works for one
    release, with a ``FutureWarning`` naming the replacement."""
    if name in _REPLACED:
        new, value, what = _REPLACED[name]
        warn_renamed(f"numpyro_pc.ef_io.{name} was replaced by {new} (it checks {what}); the old name is removed "
                     "in the next release")
        return value
    raise AttributeError(f"module 'numpyro_pc.io.expfam' has no attribute {name!r}")


def save_ef(post, path, key=None) -> Path:
    """Write the :class:`~numpyro_pc.dual.expfam.EFPosterior` ``post`` to ``path`` atomically.

    The manifest and arrays are checked as :func:`load_ef` checks them before anything is
    written. ``post.guide_map`` and ``post.record`` are not saved.

    :param key: optional HMAC key (``bytes`` or ``str``), as for :func:`numpyro_pc.io.save_load.save`.
    :return: the :class:`~pathlib.Path` written.
    :raises PersistenceError: a posterior that cannot be saved in a form that loads back.
    """
    members = {"natural": post.natural, TOMBSTONES: tombstones_member(post.tombstones)}
    if post.num_retained != post.num_examples:  # the rows hold the data of these examples only
        members["data_ids"] = np.asarray(post.data_ids, np.int64)
    arrays = with_data_arrays(members, post.data, DATA_DTYPES, post.sites)
    cfg, spec = post.config, post.config.spec
    dtype = str(arrays["natural"].dtype)
    with jax.enable_x64(dtype == "float64"):
        fingerprint = model_fingerprint(spec, post.data)
        residual = float(post.site_identity_residual)
    part = {"config": {"rule": cfg.rule, "num_nodes": int(cfg.num_nodes), "num_samples": int(cfg.num_samples),
                       "seed": int(cfg.seed)},
            "conjugate_prior": bool(post.conjugate_prior), "next_id": int(post.next_id)}
    manifest = build_manifest(KIND, {f.site: f.family_name for f in post.family.factors}, dtype, part,
                              binding_manifest(spec, post.data, arrays, residual, fingerprint, key is not None),
                              post.stale_sites)
    return write_checked(path, manifest, arrays, check_file, key=key)


# --------------------------------------------------------------------------- loading


def _inconsistent(name, expected, found) -> NoReturn:
    raise InconsistentFileError(f"array {name!r}: expected {expected}, found {found}")


def load_ef(path, model, manifest: dict, arrays: dict) -> EFPosterior:
    """Bind the arrays of an ``"ef"`` file (read, upgraded to version 2 and checked against its
    manifest by :func:`numpyro_pc.io.file_format.read_posterior_file`) to ``model`` and check them
    with the model (see the module docstring).

    :return: an :class:`~numpyro_pc.dual.expfam.EFPosterior` (no ``guide_map``).
    :raises InconsistentFileError: arrays that do not fit the family or each other, a
        natural parameter outside the domain, an altered residual or prior.
    :raises SavedModelMismatchError: a model other than the one the file was saved with.
    """
    dtype, part = manifest["dtype"], manifest["ef"]
    with jax.enable_x64(dtype == "float64"):
        spec, data = bind_saved_model(path, model, manifest, arrays, allow_discrete=True)
        probe = ModelData(tuple(x if x.shape[0] else jnp.zeros((1, *x.shape[1:]), x.dtype) for x in data.per_example),
                          data.shared)  # the model is traced on one row: a zero row when none was kept
        try:
            family = family_for_model(spec, probe, manifest["family"])
        except PosteriorCorrectionError as err:
            raise SavedModelMismatchError(f"{path}: the model's latent sites cannot carry the saved families "
                                          f"{manifest['family']} ({err})") from err
        size = arrays["natural"].shape[0]
        if family.size != size:
            _inconsistent("natural", f"{family.size} natural parameters (the family {manifest['family']} of "
                          f"the model's latent shapes {list(spec.latent.shapes)})", f"{size}")
        natural = to_device(arrays["natural"])
        sites = EFSiteTable.from_arrays(site_arrays(arrays))
        if not bool(family.in_domain(natural)):
            _inconsistent("natural", "a natural parameter inside the family's domain (positive shape parameters)",
                          _describe(family, natural))
        config = _config(path, spec, family, part["config"])
        post = EFPosterior(config=config, data=data, state=EFState(natural, sites),
                           conjugate_prior=part["conjugate_prior"], guide_map=None, tombstones=read_tombstones(arrays),
                           next_id=part["next_id"], data_ids=arrays.get("data_ids"))
        residual = float(post.residual)
        check_residual(manifest.get("residual"), residual, dtype)
        if post.conjugate_prior:
            _check_conjugate_prior(path, post, probe)
    return post.evolve(record=LoadInfo(residual=residual),
                       stale_sites=manifest["stale_sites"])


def _describe(family, natural) -> str:
    try:
        return repr(family.describe(natural))
    except Exception:  # a description is only for the message
        return repr(np.asarray(natural).tolist())


def _config(path, spec, family, saved) -> EFConfig:
    """The site computation's configuration, rebuilt and compared with the saved one."""
    try:
        config = EFConfig.make(spec, family, saved["rule"], saved["num_nodes"], saved["num_samples"], saved["seed"])
    except PosteriorCorrectionError as err:
        raise InconsistentFileError(f"{path}: the saved configuration {saved} does not apply to the family "
                                    f"{[f.family_name for f in family.factors]} ({err})") from err
    found = {"rule": config.rule, "num_nodes": config.num_nodes, "num_samples": config.num_samples,
             "seed": config.seed}
    if found != saved:
        raise InconsistentFileError(f"{path}: manifest field 'ef.config': expected a configuration the family "
                                    f"admits ({found}), found {saved}")
    return config


def _check_conjugate_prior(path, post, probe) -> None:
    r"""A conjugate-form prior is stored as :math:`\lambda_0 = -g_0`: :math:`\log p_0(x)` of the model
    minus the log density of that family member must be constant in :math:`x` (zero for a
    normalised prior), checked at a few draws of the posterior."""
    spec, family = post.config.spec, post.family
    draws = family.sample(post.natural, jax.random.PRNGKey(0), _PRIOR_PROBES)
    model = jax.vmap(lambda point: -factor_prior_loss(spec, family, point, probe))(draws)
    diff = model - family.log_prob(post.sites.prior_natural(), draws)
    model, diff = np.asarray(model), np.asarray(diff)
    rtol = 1e-8 if diff.dtype == np.float64 else 1e-3
    spread = float(np.max(diff) - np.min(diff)) if diff.size else 0.0
    scale = 1.0 + float(np.max(np.abs(model))) if model.size else 1.0
    if not (math.isfinite(spread) and spread <= rtol * scale):
        raise InconsistentFileError(
            f"{path}: array 'prior': expected the model's conjugate-form prior λ_0 = -g_0 (log p_0(x) - log q_0(x) "
            f"constant over draws), found a difference varying by {spread:.3g} (the prior site was altered, or the "
            "prior is not conjugate-form)")
