r"""The model evaluated at draws of an exponential-family product posterior (issue 13).

An :class:`~numpyro_pc.dual.expfam.EFPosterior` has its draws in each factor's own
coordinates (constrained values for Beta/Gamma/Dirichlet, unconstrained values for Gaussian
factors, integers for discrete ones), while the model binding of :mod:`numpyro_pc.model.likelihood`
takes the flat unconstrained vector :math:`z` and the discrete values;
:func:`numpyro_pc.sites.expfam.model_point` maps one to the other.
:func:`factor_prior_loss` is the prior term as a density of the factors' coordinates (the
log-Jacobian added back for the factors on constrained values),
:func:`log_likelihood` the per-example log-likelihood of each observed site of the data
plate, and :func:`inference_data` the ArviZ ``InferenceData`` behind
:meth:`EFPosterior.to_arviz <numpyro_pc.dual.expfam.EFPosterior.to_arviz>` (the same groups
as :meth:`numpyro_pc.dual.base.DualPosteriorBase.to_arviz`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.model.likelihood import example_site_log_likelihoods, prior_loss, trace_at

from .expfam import model_point
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["factor_prior_loss", "log_likelihood", "inference_data"]


def factor_prior_loss(spec, family, point, data) -> jax.Array:
    """:math:`-\\log p_0` at one ``point`` (factor coordinates) as a density of those coordinates."""
    z, discrete, log_det = model_point(spec, family, point)
    return prior_loss(spec, z, data, discrete) + log_det


def log_likelihood(post, draws) -> dict[Any, jax.Array]:
    """Per-example log-likelihood of each observed site at ``draws`` in factor coordinates.

    :param post: an :class:`~numpyro_pc.dual.expfam.EFPosterior`.
    :param dict draws: ``{site: (S, *shape)}`` (e.g. ``post.family.sample(post.natural, key, S)``).
    :return: ``{observed site: (S, N)}`` in ``spec.observed`` order; an example's values of
        one site are summed whatever its event or inner-plate shape.
    """
    spec, data = post.config.spec, post.data
    num = next(iter(draws.values())).shape[0]

    def at(point):
        z, discrete, _ = model_point(spec, post.family, point)
        return jax.vmap(lambda ex: example_site_log_likelihoods(spec, z, ex, data.shared, discrete))(
            data.per_example)

    values = jax.vmap(at)(draws)
    return {name: jnp.reshape(v, (num, -1)) for name, v in zip(spec.observed, values)}


def inference_data(post, key, num_samples=1000) -> Any:
    """ArviZ ``InferenceData`` of ``post`` with one chain of ``num_samples`` draws.

    ``posterior`` holds the constrained draws of each latent site, ``log_likelihood`` one
    ``(chain, draw, N)`` variable per observed site of the data plate and, when an example
    has several observed sites, their sum ``"joint"``; ``observed_data`` the observations.
    """
    import arviz as az

    spec, data = post.config.spec, post.data
    draws = post.family.sample(post.natural, key, int(num_samples))
    loglik = log_likelihood(post, draws)
    if len(loglik) > 1 and "joint" not in loglik:
        loglik["joint"] = sum(loglik.values())
    posterior = {k: np.asarray(v)[None] for k, v in post.family.to_constrained(draws).items()}
    log_lik = {k: np.asarray(v)[None] for k, v in loglik.items()}
    dims = {k: [spec.plate] for k in log_lik}
    z, discrete, _ = model_point(spec, post.family, {k: v[0] for k, v in draws.items()})
    trace = trace_at(spec, z, data.per_example, data.shared, discrete)
    observed = {k: np.asarray(trace[k]["value"]) for k in spec.observed}
    for k, v in observed.items():
        dims.setdefault(k, [spec.plate] + [f"{k}_dim_{j}" for j in range(v.ndim - 1)])
    return az.from_dict(posterior=posterior, log_likelihood=log_lik, observed_data=observed, dims=dims)
