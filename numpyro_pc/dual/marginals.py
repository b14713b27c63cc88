"""Per-site marginals of a Gaussian dual-form posterior as NumPyro distributions of the constrained values
(:meth:`numpyro_pc.dual.base.DualPosteriorBase.distributions`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from numpyro import distributions as dist
from numpyro.distributions.transforms import IdentityTransform, ReshapeTransform, biject_to

from numpyro_pc.errors import MissingCapabilityError
from numpyro_pc.model import probes
from numpyro_pc.model.likelihood import trace_at

if TYPE_CHECKING:
    from numpyro.distributions import Distribution

__all__ = ["site_marginals"]


def site_marginals(post) -> dict[str, Distribution]:
    """Each latent site's marginal (see :meth:`~numpyro_pc.dual.base.DualPosteriorBase.distributions`)."""
    latent, q = post.spec.latent, post.state
    # the supports do not depend on the examples: one row (a zero row when the posterior keeps no data)
    first = tuple(x[:1] if x.shape[0] else jnp.zeros((1,) + tuple(x.shape[1:]), x.dtype) for x in post.data.per_example)
    at_mean = trace_at(post.spec, q.mean, first, post.data.shared)
    elsewhere = trace_at(post.spec, q.mean + 0.5 * probes.normal(7, q.mean.shape, q.mean.dtype), first,
                         post.data.shared)
    diagonal = jnp.ndim(q.precision) <= 1
    cov = None if diagonal or post.is_point_estimate else post.family.covariance_operand(q)
    out = {}
    for name, ushape, start, size in zip(latent.names, latent.unconstrained_shapes, latent.offsets, latent.sizes):
        transform = biject_to(at_mean[name]["fn"].support)
        u = probes.normal(11, (size,), q.mean.dtype).reshape(ushape)
        if not np.allclose(np.asarray(transform(u)), np.asarray(biject_to(elsewhere[name]["fn"].support)(u))):
            raise MissingCapabilityError(
                f"post.distributions() needs each site's support fixed; the support of {name!r} "
                f"({at_mean[name]['fn'].support}) depends on other latents, so its marginal is not a transformed "
                "Gaussian of its own coordinates: draw it with post.sample(key, n)")
        mean = q.mean[start:start + size]
        if post.is_point_estimate:
            value = transform(jnp.reshape(mean, ushape))
            out[name] = dist.Delta(value, event_dim=jnp.ndim(value))
            continue
        if diagonal:
            precision = jnp.broadcast_to(q.precision, q.mean.shape)[start:start + size]
            gaussian = dist.Normal(mean, jnp.sqrt(1.0 / precision)).to_event(1)
        else:
            select = jnp.zeros((post.dim, size), mean.dtype).at[start + jnp.arange(size), jnp.arange(size)].set(1.0)
            block = post.family.cov_times(q, cov, select)[start:start + size]
            gaussian = dist.MultivariateNormal(mean, covariance_matrix=0.5 * (block + block.T))
        parts = [] if tuple(ushape) == (size,) else [ReshapeTransform(tuple(ushape), (size,))]
        parts += [] if isinstance(transform, IdentityTransform) else [transform]
        out[name] = dist.TransformedDistribution(gaussian, parts) if parts else gaussian
    return out
