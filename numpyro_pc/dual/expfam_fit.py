r"""Fitting a mean-field exponential-family posterior: by the BLR from the prior (:func:`fit_ef`)
or from a fitted hand-written guide (:func:`dual_form_ef`), each to the dual-form fixed point
:math:`\lambda = -g_0 - \sum_i g_i` (paper eq. ``qdualform``).

The entry points :func:`numpyro_pc.fit` (with a ``{site: family}`` dict) and
:func:`numpyro_pc.dual_form` (with a hand-written guide) call these.
"""

from __future__ import annotations

import jax.numpy as jnp

from numpyro_pc.errors import InvalidOptionError, OutOfDomainError, UnsupportedGuideError
from numpyro_pc.families.product import family_for_model, make_factor, site_names, site_shape, site_supports
from numpyro_pc.guides.expfam import read_guide
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.model.local_binding import refuse_guide_over_locals
from numpyro_pc.protocols.records import FitInfo
from numpyro_pc.sites.expfam import EFConfig, conjugate_rtol, prior_form_residual
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.solvers.expfam import bucketed_target, solve_every_site
from numpyro_pc.solvers.fixed_point import in_domain_host

from .expfam import EFPosterior, EFState

__all__ = ["fit_ef", "dual_form_ef"]


def _build(spec, data, fam, lam, guide_map, options, operation) -> EFPosterior:
    opts = dict(options)
    cfg = EFConfig.make(spec, fam, opts.pop("expectation", "auto"), opts.pop("num_nodes", 32),
                        opts.pop("num_samples", None), opts.pop("seed", 0))
    tol, max_iters = opts.pop("tol", None), opts.pop("max_iters", 200)
    raise_on_failure, refine = opts.pop("raise_on_failure", True), opts.pop("refine", True)
    if opts:
        raise InvalidOptionError(f"unknown options {sorted(opts)}")
    lam = jnp.asarray(lam, jnp.result_type(float))
    if not in_domain_host(fam.in_domain, lam):
        raise OutOfDomainError(f"the start is outside the family's domain: {fam.describe(lam)}")
    _, sites = bucketed_target(cfg, data, True, jnp.zeros_like(lam))(lam)
    conjugate = bool(prior_form_residual(cfg, lam, data, sites) < conjugate_rtol(lam.dtype))
    ids = jnp.arange(spec.num_examples)
    post = EFPosterior(cfg, data, EFState(lam, EFSiteTable(sites.grads, sites.prior, ids)), conjugate, guide_map)
    if not refine:
        return post.evolve(record=FitInfo(operation="read", residual=post.residual))
    if guide_map is None and conjugate:
        lam = -sites.prior  # from the prior itself
        post = post.evolve(state=post.state._replace(natural=lam))
    solved = solve_every_site(post, data, ids, lam, tol, max_iters, raise_on_failure, warm=guide_map is not None)
    return solved.evolve(record=solved.record.replace(operation=operation))


def fit_ef(model, *args, family, data_plate=None, shared=(), **options) -> EFPosterior:
    """Fit a mean-field exponential-family posterior by the BLR from the prior.

    :param dict family: ``{latent site: name}`` covering every site, names from
        :data:`~numpyro_pc.families.product.EF_FAMILIES` (``"beta"``, ``"gamma"``, ``"dirichlet"``,
        ``"normal"``/``"lognormal"``, ``"full"``, ``"bernoulli"``, ``"categorical"``).
    :param options: ``expectation`` (``"auto"``, ``"quadrature"``, ``"cubature"``, ``"mixed"``, ``"mc"``), ``num_nodes``,
        ``num_samples``, ``seed``, ``tol``, ``max_iters``, ``raise_on_failure``; the rest are
        the model's keyword arguments.
    """
    opts = {k: options.pop(k) for k in list(options) if k in _OPTIONS}
    spec, data = bind_model(model, args, options, data_plate=data_plate, shared=shared, allow_discrete=True)
    fam = family_for_model(spec, data, family)
    return _build(spec, data, fam, fam.default_natural(jnp.result_type(float)), None, opts, "fit")


def dual_form_ef(model, guide, params, *args, data_plate=None, shared=(), **options) -> EFPosterior:
    """A fitted exponential-family guide (hand-written, or an ``AutoGuideList`` of such parts
    and ``AutoNormal``) as an :class:`EFPosterior` (sites computed at the guide, then refined
    to the fixed point unless ``refine=False``)."""
    opts = {k: options.pop(k) for k in list(options) if k in _OPTIONS}
    spec, data = bind_model(model, args, options, data_plate=data_plate, shared=shared, allow_discrete=True)
    refuse_guide_over_locals(spec)
    supports = site_supports(spec, data)
    gmap, lam = read_guide(guide, params, site_names(spec), args, options, supports)
    for f in gmap.family.factors:  # the guide's factors must fit the model's supports and shapes
        expected = make_factor(f.family_name, f.site, site_shape(spec, f.site), supports[f.site])
        if expected.size != f.size:
            raise UnsupportedGuideError(f"guide site {f.site!r} has {f.size} natural parameters but the model's site "
                                        f"needs {expected.size} (shape {site_shape(spec, f.site)})")
    return _build(spec, data, gmap.family, lam, gmap, opts, "dual_form")


_OPTIONS = ("expectation", "num_nodes", "num_samples", "seed", "tol", "max_iters", "raise_on_failure", "refine")
