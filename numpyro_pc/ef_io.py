r"""Saving and loading a exponential-family :class:`~numpyro_pc.ef_posterior.EFPosterior`.

The file is the container of :mod:`numpyro_pc.io` (one uncompressed zip of ``.npy``
members and a ``manifest.json``, written atomically by
:func:`numpyro_pc.archive.write_atomic`, read with bounds by
:func:`numpyro_pc.archive.read_archive`, optionally signed with an HMAC key). Its
manifest has ``"kind": "ef"`` and records

- ``family``: ``{latent site: family name}`` in the model's latent order;
- ``config``: the site computation's ``rule``, ``num_nodes``, ``num_samples`` and ``seed``;
- ``conjugate_prior`` and ``dtype``;
- the model binding of the Gaussian files (latent signature, data plate, observed sites,
  argument layout, per-example shapes, model :mod:`fingerprint <numpyro_pc.fingerprint>`);
- the dual-form residual :math:`\|\lambda + g_0 + \sum_i g_i\| / (1 + \|g_0 + \sum_i g_i\|)`
  and a SHA-256 of each array: ``natural`` :math:`\lambda` ``(P,)``, ``grads`` (the sites
  :math:`g_i`, ``(N, P)``), ``prior`` (:math:`g_0`, ``(P,)``), ``ids`` ``(N,)`` and the data rows.

:func:`numpyro_pc.io.save` and :func:`numpyro_pc.io.load` dispatch here. Loading treats
the file as untrusted (:func:`check_ef_manifest`, :func:`check_ef_contents`), binds the
model and compares its fingerprint, rebuilds the family from the names with
:func:`~numpyro_pc.ef_posterior.family_for_model`, and checks that the arrays have the
family's size, that :math:`\lambda` is inside the family's domain, that the dual-form
residual recomputed from the arrays is the one recorded (:math:`\lambda = -g_0 - \sum_i g_i`
is what updates and deletions rely on), and, for a conjugate-form prior, that
:math:`-g_0` is the model's prior (:math:`\log p_0(x) - \langle -g_0, T(x)\rangle` constant
over draws). The hand-written guide a posterior was read from is code and is not saved:
pass it to :meth:`~numpyro_pc.ef_posterior.EFPosterior.to_guide_params` after loading.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from .ef_eval import factor_prior_loss
from .ef_posterior import EFConfig, EFPosterior, EFState, family_for_model
from .ef_site_table import EFSiteTable
from .errors import (CorruptFileError, DtypeMismatchError, FormatVersionError, InconsistentFileError,
                     PosteriorCorrectionError, SavedModelMismatchError)
from .fingerprint import model_fingerprint
from .saved_model import bind_saved_model, binding_manifest, with_data_arrays, write_checked
from .likelihood import ModelData
from .rowops import to_device
from .validation import (DATA_DTYPES, FLOAT_DTYPES, FORMAT, INT_DTYPES, VERSION, check_array_entries,
                         check_binding_fields, check_example_rows, check_residual, fail_field)

__all__ = ["KIND", "save_ef", "load_ef", "check_ef_manifest", "check_ef_contents"]

KIND = "ef"
_FIELDS = {"format", "version", "kind", "family", "config", "conjugate_prior", "dtype", "latent", "plate", "observed",
           "arguments", "example_shapes", "arrays", "residual", "fingerprint", "signed", "stale_sites"}
_NAME = re.compile(r"(natural|grads|prior|ids|data\.(example|shared)\.\d+)")
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,31}")
_CONFIG = {"num_nodes": (1, 10**4), "num_samples": (1, 10**7), "seed": (0, 2**32)}
_MAX_ID = 2**62
_PRIOR_PROBES = 8  # draws at which a conjugate-form prior is compared with the model's


def _arrays(post):
    arrays = {"natural": post.natural, **post.sites.arrays()}  # natural, grads, prior, ids: the file's order
    return with_data_arrays(arrays, post.data, DATA_DTYPES)


def save_ef(post, path, key=None):
    """Write the :class:`~numpyro_pc.ef_posterior.EFPosterior` ``post`` to ``path`` atomically.

    The manifest and arrays are checked as :func:`load_ef` checks them before anything is
    written. ``post.guide_map`` and ``post.record`` are not saved.

    :param key: optional HMAC key (``bytes`` or ``str``), as for :func:`numpyro_pc.io.save`.
    :return: the :class:`~pathlib.Path` written.
    :raises PersistenceError: a posterior that cannot be saved in a form that loads back.
    """
    arrays = _arrays(post)
    cfg, spec = post.config, post.config.spec
    dtype = str(arrays["natural"].dtype)
    with jax.enable_x64(dtype == "float64"):
        fingerprint = model_fingerprint(spec, post.data)
        residual = float(post.site_identity_residual)
    manifest = {
        "format": FORMAT, "version": VERSION, "kind": KIND,
        "family": {f.site: f.family_name for f in post.family.factors},
        "config": {"rule": cfg.rule, "num_nodes": int(cfg.num_nodes), "num_samples": int(cfg.num_samples),
                   "seed": int(cfg.seed)},
        "conjugate_prior": bool(post.conjugate_prior), "dtype": dtype,
        **binding_manifest(spec, post.data, arrays, residual, fingerprint, key is not None),
    }
    if post.stale_sites:  # written only when true: files of other posteriors are unchanged
        manifest["stale_sites"] = True
    return write_checked(path, manifest, arrays, _check_file, key=key)


def _check_file(manifest, arrays) -> None:
    check_ef_manifest(manifest)
    check_ef_contents(manifest, arrays)


# --------------------------------------------------------------------------- checks of the file alone


def _is_int(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def check_ef_manifest(manifest):
    """Check the schema of an ``"ef"`` manifest.

    :return: ``{array name: (dtype, shape, sha256)}`` of the declared arrays.
    :raises CorruptFileError: a field is missing, of the wrong type or out of range.
    :raises FormatVersionError: another format version.
    """
    if manifest.get("format") != FORMAT:
        raise CorruptFileError(f"not a saved posterior: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise FormatVersionError(f"format version {manifest.get('version')!r}; this numpyro_pc reads version {VERSION}")
    if manifest.get("kind") != KIND:
        fail_field("kind", f"{KIND!r} (an exponential-family posterior) or no kind (a Gaussian one)",
                   manifest.get("kind"))
    unknown = sorted(set(manifest) - _FIELDS, key=str)
    if unknown:
        fail_field(unknown[0], f"only the fields {sorted(_FIELDS)}", manifest[unknown[0]])
    if manifest.get("stale_sites", False) is not False and manifest.get("stale_sites") is not True:
        fail_field("stale_sites", "true (written only for a posterior whose retained sites are stale)",
                   manifest.get("stale_sites"))
    if manifest.get("dtype") not in FLOAT_DTYPES:
        fail_field("dtype", f"one of {list(FLOAT_DTYPES)}", manifest.get("dtype"))
    if not isinstance(manifest.get("conjugate_prior"), bool):
        fail_field("conjugate_prior", "true or false", manifest.get("conjugate_prior"))
    config = manifest.get("config")
    if not isinstance(config, dict) or set(config) != {"rule", *_CONFIG}:
        fail_field("config", f"an object with the fields {sorted({'rule', *_CONFIG})}", config)
    if not isinstance(config["rule"], str) or not _IDENTIFIER.fullmatch(config["rule"]):
        fail_field("config.rule", "the name of an expectation rule (e.g. 'quadrature' or 'mc')", config["rule"])
    for name, (low, high) in _CONFIG.items():
        if not _is_int(config[name], low, high):
            fail_field(f"config.{name}", f"{low} ≤ integer < {high}", config[name])
    num_example, num_shared = check_binding_fields(manifest)
    family = manifest.get("family")
    names = manifest["latent"]["names"] + manifest["latent"].get("discrete_names", [])
    if not isinstance(family, dict) or list(family) != names or not all(
            isinstance(v, str) and _IDENTIFIER.fullmatch(v) for v in family.values()):
        fail_field("family", f"an object naming the family of each latent site {names}, in that order", family)
    return check_array_entries(manifest, _NAME, {"natural", "grads", "prior", "ids"}, num_example, num_shared,
                               what="an exponential-family posterior")


def _inconsistent(name, expected, found):
    raise InconsistentFileError(f"array {name!r}: expected {expected}, found {found}")


def check_ef_contents(manifest, arrays):
    """Check that the arrays agree with the manifest and with each other: dtypes, shapes
    (``natural (P,)``, ``prior (P,)``, ``grads (N, P)``, ``ids (N,)``, ``N`` data rows),
    finite values, unique non-negative ids. The family's size ``P`` is checked on load,
    once the model is bound.

    :raises InconsistentFileError, DtypeMismatchError:
    """
    dtype = manifest["dtype"]
    for name in ("natural", "grads", "prior"):
        if str(arrays[name].dtype) != dtype:
            raise DtypeMismatchError(f"array {name!r}: expected dtype {dtype} (the manifest's), found "
                                     f"{arrays[name].dtype}")
    ids = arrays["ids"]
    if str(ids.dtype) not in INT_DTYPES:
        _inconsistent("ids", f"an integer dtype {INT_DTYPES}", ids.dtype)
    if arrays["natural"].ndim != 1:
        _inconsistent("natural", "a vector (P,)", f"shape {arrays['natural'].shape}")
    size = arrays["natural"].shape[0]
    rows = ids.shape[0] if ids.ndim == 1 else -1
    for name, shape in (("prior", (size,)), ("grads", (rows, size)), ("ids", (rows,))):
        if arrays[name].shape != shape:
            _inconsistent(name, f"shape {shape} (P={size} natural parameters, N={rows} sites)", arrays[name].shape)
    check_example_rows(manifest, arrays, rows)
    if ids.size and (ids.min() < 0 or ids.max() >= _MAX_ID):
        _inconsistent("ids", f"ids in [0, {_MAX_ID})", f"ids from {ids.min()} to {ids.max()}")
    if np.unique(ids).size != ids.size:
        _inconsistent("ids", "unique ids", f"{ids.size - np.unique(ids).size} duplicate(s)")


# --------------------------------------------------------------------------- loading


def load_ef(path, model, manifest, arrays):
    """Bind the arrays of an ``"ef"`` file (read and schema-checked by :func:`numpyro_pc.io.load`)
    to ``model`` and check them (see the module docstring).

    :return: an :class:`~numpyro_pc.ef_posterior.EFPosterior` (no ``guide_map``).
    :raises InconsistentFileError: arrays that do not fit the family or each other, a
        natural parameter outside the domain, an altered residual or prior.
    :raises SavedModelMismatchError: a model other than the one the file was saved with.
    """
    check_ef_contents(manifest, arrays)
    dtype = manifest["dtype"]
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
        sites = EFSiteTable.from_arrays({k: to_device(arrays[k]) for k in ("grads", "prior", "ids")})
        if not bool(family.in_domain(natural)):
            _inconsistent("natural", "a natural parameter inside the family's domain (positive shape parameters)",
                          _describe(family, natural))
        config = _config(path, spec, family, manifest["config"])
        post = EFPosterior(config=config, data=data, state=EFState(natural, sites),
                           conjugate_prior=manifest["conjugate_prior"], guide_map=None)
        residual = float(post.residual)
        check_residual(manifest["residual"], residual, dtype)
        if post.conjugate_prior:
            _check_conjugate_prior(path, post, probe)
    return post.evolve(record=dict(operation="load", residual=residual),
                       stale_sites=manifest.get("stale_sites", False))


def _describe(family, natural):
    try:
        return repr(family.describe(natural))
    except Exception:  # a description is only for the message
        return repr(np.asarray(natural).tolist())


def _config(path, spec, family, saved):
    """The site computation's configuration, rebuilt and compared with the saved one."""
    try:
        config = EFConfig.make(spec, family, saved["rule"], saved["num_nodes"], saved["num_samples"], saved["seed"])
    except PosteriorCorrectionError as err:
        raise InconsistentFileError(f"{path}: the saved configuration {saved} does not apply to the family "
                                    f"{[f.family_name for f in family.factors]} ({err})") from err
    found = {"rule": config.rule, "num_nodes": config.num_nodes, "num_samples": config.num_samples,
             "seed": config.seed}
    if found != saved:
        raise InconsistentFileError(f"{path}: manifest field 'config': expected a configuration the family "
                                    f"admits ({found}), found {saved}")
    return config


def _check_conjugate_prior(path, post, probe):
    r"""A conjugate-form prior is stored as :math:`\lambda_0 = -g_0`: :math:`\log p_0(x)` of the model
    minus the log density of that family member must be constant in :math:`x` (zero for a
    normalised prior), checked at a few draws of the posterior."""
    spec, family = post.config.spec, post.family
    draws = family.sample(jax.random.PRNGKey(0), post.natural, _PRIOR_PROBES)
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
