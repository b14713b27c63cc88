"""Fixed, seeded probe points drawn on the host.

Binding a model and choosing its expectation rule evaluate it at a few generic points: to
find which latents each example depends on, whether its distribution parameters are affine
in them, whether the prior's Hessian is diagonal or constant, and whether the per-example
losses add up to the model's log density. Those points only need to be generic and
reproducible. Drawn with NumPy they cost nothing to compile; drawn with ``jax.random`` outside
``jit`` each shape compiled its own sampler (1–3 s of a cold ``pc.fit`` on two cores), see
``benchmarks/RESULTS.md`` ("Cold start").
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions.transforms import biject_to

__all__ = ["normal", "uniform", "coin_flips", "prototype_value"]


def _generator(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed)))


def normal(seed: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Standard-normal draws of ``shape`` in ``dtype``, the same for the same ``seed`` in every process
    (a host array: a constant wherever it is used, also inside traced code)."""
    return _generator(seed).standard_normal(shape).astype(np.dtype(dtype))


def uniform(seed: int, shape: tuple[int, ...], low: float, high: float, dtype) -> np.ndarray:
    """Uniform draws on ``[low, high)`` of ``shape`` in ``dtype``, the same for the same ``seed``."""
    return _generator(seed).uniform(low, high, shape).astype(np.dtype(dtype))


def coin_flips(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Fair boolean draws of ``shape``, the same for the same ``seed``."""
    return _generator(seed).random(shape) < 0.5



def prototype_value(site) -> jax.Array | None:
    """A value for a continuous latent site that does not call its sampler (a ``substitute_fn``).

    Uniform in ``(−2, 2)`` in unconstrained space (as NumPyro's ``init_to_uniform``), built
    from the distribution's shape and support alone, so priors without a sampler — Stan's
    flat priors as ``ImproperUniform``, truncated distributions whose sampler needs an
    optional dependency — bind like any other.
    """
    if site["type"] != "sample" or site["is_observed"] or site["fn"].support.is_discrete:
        return None
    transform = biject_to(site["fn"].support)
    shape = tuple(transform.inverse_shape(site["fn"].shape()))
    seed = zlib.crc32(site["name"].encode())  # deterministic across processes
    return transform(jnp.asarray(uniform(seed, shape, -2.0, 2.0, jnp.result_type(float))))
