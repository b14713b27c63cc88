r"""The model evaluated at draws of a Beta/Gamma/Dirichlet posterior (issue 13).

An :class:`~numpyro_pc.ef_posterior.EFPosterior` lives on the model's **constrained**
latent values :math:`x`, while the model binding of :mod:`numpyro_pc.likelihood` takes
the flat unconstrained vector :math:`z`. :func:`unconstrain` maps one point with each
site's ``biject_to(support).inv`` (the transforms recorded in the model's
:class:`~numpyro_pc.latent.LatentSpace`) and returns the log-Jacobian
:math:`\log|\det J_T(z)|` of the constraining map, so that densities of :math:`x` follow:
:func:`constrained_prior_loss` is :math:`-\log p_0(x) = \ell_0(z) + \log|\det J_T(z)|`.

:func:`log_likelihood` gives the per-example log-likelihood of each observed site of the
data plate at draws of the posterior, and :func:`inference_data` the ArviZ
``InferenceData`` behind :meth:`EFPosterior.to_arviz <numpyro_pc.ef_posterior.EFPosterior.to_arviz>`
(the same groups as :meth:`numpyro_pc.dual.DualPosteriorBase.to_arviz`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .likelihood import example_site_log_likelihoods, prior_loss, trace_at

__all__ = ["unconstrain", "constrained_prior_loss", "log_likelihood", "inference_data"]


def unconstrain(spec, values):
    """Flat unconstrained ``z`` of one point ``{site: constrained value}`` and ``log|det J_T(z)|``.

    :param spec: the :class:`~numpyro_pc.likelihood.ModelSpec`.
    :param dict values: a value of every latent site (constrained, unbatched).
    :return: ``(z (d,), log_det)``.
    """
    parts, log_det = [], 0.0
    for name, transform in zip(spec.latent.names, spec.latent.transforms):
        x = jnp.asarray(values[name])
        u = transform.inv(x)
        parts.append(jnp.reshape(u, (-1,)))
        log_det = log_det + jnp.sum(transform.log_abs_det_jacobian(u, x))
    return jnp.concatenate(parts), log_det


def constrained_prior_loss(spec, values, data):
    """:math:`-\\log p_0(x)`: the prior term at constrained ``values`` (one point), density of ``x``."""
    z, log_det = unconstrain(spec, values)
    return prior_loss(spec, z, data) + log_det


def log_likelihood(post, draws):
    """Per-example log-likelihood of each observed site at constrained ``draws``.

    :param post: an :class:`~numpyro_pc.ef_posterior.EFPosterior`.
    :param dict draws: ``{site: (S, *shape)}`` (e.g. from ``post.sample``).
    :return: ``{observed site: (S, N)}`` in ``spec.observed`` order; an example's values of
        one site are summed whatever its event or inner-plate shape.
    """
    spec, data = post.config.spec, post.data
    z = jax.vmap(lambda point: unconstrain(spec, point)[0])(draws)

    def at(zz):
        return jax.vmap(lambda ex: example_site_log_likelihoods(spec, zz, ex, data.shared))(data.per_example)

    values = jax.vmap(at)(z)
    return {name: jnp.reshape(v, (z.shape[0], -1)) for name, v in zip(spec.observed, values)}


def inference_data(post, key, num_samples=1000):
    """ArviZ ``InferenceData`` of ``post`` with one chain of ``num_samples`` draws.

    ``posterior`` holds the constrained draws of each latent site, ``log_likelihood`` one
    ``(chain, draw, N)`` variable per observed site of the data plate and, when an example
    has several observed sites, their sum ``"joint"``; ``observed_data`` the observations.
    """
    import arviz as az

    spec, data = post.config.spec, post.data
    draws = post.sample(key, int(num_samples))
    loglik = log_likelihood(post, draws)
    if len(loglik) > 1 and "joint" not in loglik:
        loglik["joint"] = sum(loglik.values())
    posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
    log_lik = {k: np.asarray(v)[None] for k, v in loglik.items()}
    dims = {k: [spec.plate] for k in log_lik}
    z = unconstrain(spec, {k: v[0] for k, v in draws.items()})[0]
    trace = trace_at(spec, z, data.per_example, data.shared)
    observed = {k: np.asarray(trace[k]["value"]) for k in spec.observed}
    for k, v in observed.items():
        dims.setdefault(k, [spec.plate] + [f"{k}_dim_{j}" for j in range(v.ndim - 1)])
    return az.from_dict(posterior=posterior, log_likelihood=log_lik, observed_data=observed, dims=dims)
