"""The clients of an exponential-family federated run: their shards bound to the model, the family, the site
rule and the prior :math:`\\lambda_0` (:func:`bind_ef_clients`), and the check that a private run's prior
carries no data (:func:`check_prior_data_free`)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pc.dual.expfam import family_for_model
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.sites.expfam import EFConfig, compute_sites, conjugate_rtol, prior_form_residual
from numpyro_pc.solvers.expfam import blr_solve

from .core import ClientStack, bind_clients
from .privacy import check_same_on_every_row

__all__ = ["EFClients", "bind_ef_clients", "check_prior_data_free"]


class EFClients(NamedTuple):
    """The clients' shards bound to the model (static across rounds).

    :ivar config: :class:`~numpyro_pc.sites.expfam.EFConfig` for the padded shard size.
    :ivar stack: the padded :class:`~numpyro_pc.federated.core.ClientStack`.
    :ivar datas: the unpadded :class:`~numpyro_pc.model.likelihood.ModelData` of each client.
    :ivar prior: :math:`\\lambda_0` ``(P,)``: the prior (conjugate-form) or its projection.
    :ivar conjugate: whether the prior term is conjugate-form.
    :ivar prior_weight: ``(K,)``: 1 for the client whose loss carries a non-conjugate prior's correction.
    """

    config: EFConfig
    stack: ClientStack
    datas: tuple
    prior: jax.Array
    conjugate: bool
    prior_weight: jax.Array


def bind_ef_clients(model, client_data, family, kwargs=None, data_plate=None, shared=(), expectation="auto",
                    num_nodes=32, num_samples=None, seed=0, prior_tol=None, prior_iters=200) -> EFClients:
    """Bind each client's shard, build the family and the site rule (as :func:`~numpyro_pc.dual.expfam_fit.fit_ef`
    does for the union), and find :math:`\\lambda_0`.

    :param client_data: one tuple of model arguments per client.
    :param dict family: ``{latent site: family name}`` (see :func:`~numpyro_pc.dual.expfam_fit.fit_ef`).
    :param expectation, num_nodes, num_samples, seed: the site rule (:meth:`EFConfig.make
        <numpyro_pc.sites.expfam.EFConfig.make>`); Monte Carlo draws use the fixed ``seed``, the same
        points on every client.
    :return: :class:`EFClients`.
    """
    spec, stack, datas = bind_clients(model, client_data, kwargs, data_plate, shared, allow_discrete=True)
    fam = family_for_model(spec, datas[0], family)
    cfg = EFConfig.make(spec, fam, expectation, num_nodes, num_samples, seed)
    rows = int(stack.mask.shape[1])
    one = ModelData(tuple(x[:1] for x in datas[0].per_example), datas[0].shared)
    cfg_one = replace(cfg, spec=replace(spec, num_examples=1))
    lam = fam.default_natural(stack.mask.dtype)
    sites = compute_sites(cfg_one, lam, one)
    conjugate = bool(prior_form_residual(cfg_one, lam, one, sites) < conjugate_rtol(lam.dtype))
    if conjugate:
        prior = -sites.prior
    else:  # the prior's projection onto the family: the fixed point without data
        tol = (1e-12 if lam.dtype == jnp.float64 else 1e-6) if prior_tol is None else prior_tol
        prior, _, _ = blr_solve(lambda x: (-compute_sites(cfg_one, x, one).prior, None), fam.in_domain, lam, tol,
                                prior_iters)
    weight = jnp.zeros(len(datas), lam.dtype).at[0].set(0.0 if conjugate else 1.0)
    return EFClients(replace(cfg, spec=replace(spec, num_examples=rows)), stack, tuple(datas), prior, conjugate,
                     weight)


def check_prior_data_free(clients) -> None:
    """Refuse a prior that depends on the data where the prior's term must not carry any (a private run).

    :func:`bind_ef_clients` finds :math:`\\lambda_0` from the prior term computed on one row of client 0's
    shard (a model needs its data arguments to run: plates, shapes, supports). A prior written with the data
    (``Gamma(2, 1 / mean(y))``) then holds that row, and the server receives it outside the privacy mechanism,
    which covers the examples' terms only. A data-free probe in place of the row would not help: it would
    silently change such a prior. So the prior term at one :math:`\\lambda` is computed on the first and last
    row of every client's shard; a data-free prior gives the same term on all of them (checked to 64 units of
    rounding). A dependence on rows that are all equal cannot be seen, and reveals nothing beyond them.

    :raises PrivacyError: the prior term differs between two rows, naming them and the difference.
    """
    cfg = replace(clients.config, spec=replace(clients.config.spec, num_examples=1))
    lam = cfg.family.default_natural(clients.prior.dtype)
    term = jax.jit(lambda one: compute_sites(cfg, lam, one).prior)
    check_same_on_every_row(term, clients.datas, "the prior term", "the prior's natural parameters")
