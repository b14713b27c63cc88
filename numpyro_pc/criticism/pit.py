r"""Leave-one-out importance weights and LOO-PIT from the dual form.

Draws ``z_s ~ q`` re-weighted to the cavity ``q_{∖i}`` need no smoothing: the ratio is the
site itself,

.. math::

    \log \frac{q_{\setminus i}(z_s)}{q(z_s)} = \hat\ell_i(z_s) + c_i
        = z_sᵀ \hat g_i + \tfrac12 (z_s - m_i)ᵀ \hat H_i (z_s - m_i) + c_i,

normalised over ``s`` (``c_i`` cancels); for an exponential-family product the site is
:math:`\langle g_i, T(x_s)\rangle`. :func:`loo_pit` passes these weights, the
posterior-predictive draws and the observations to :func:`arviz.loo_pit`.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro import handlers
from numpyro.primitives import Messenger

from numpyro_pc.model.likelihood import constrain, trace_at
from numpyro_pc.model.rows import positions
from numpyro_pc.protocols.posterior import by_site_table
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expfam import model_point
from numpyro_pc.sites.expfam_table import EFSiteTable

from ..errors import InvalidOptionError
from .ef_cavity import retained_grads
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["loo_log_weights", "predictive_draws", "loo_pit"]


@jax.jit
def _log_weights(sites, draws) -> jax.Array:
    def one(z) -> jax.Array:
        diff = z[None, :] - sites.refs()
        return sites.dense_grad() @ z + 0.5 * jnp.sum(diff * sites.curvature_matvec(diff), 1)

    raw = jax.lax.map(one, draws, batch_size=64)  # (S, N)
    return raw - logsumexp(raw, axis=0, keepdims=True)


def loo_log_weights(post, draws) -> np.ndarray:
    """Normalised log importance weights ``(S, N)`` of unconstrained ``draws`` of ``post`` for every
    example with retained data: ``q_{∖i}/q`` exactly (no Pareto smoothing needed)."""
    with jax.enable_x64(post.state.mean.dtype == jnp.float64):
        rows = positions(np.asarray(post.sites.ids), np.asarray(post.data_ids))
        return np.asarray(_log_weights(post.sites.take(rows), jnp.asarray(draws)))


class _Unobserve(Messenger):
    """Turn the observed sites ``names`` into samples from their distributions."""

    def __init__(self, fn, names):
        self.names = set(names)
        super().__init__(fn)

    def process_message(self, msg) -> None:
        if msg["type"] == "sample" and msg["name"] in self.names and msg.get("is_observed"):
            msg["observed_value"] = msg["value"]
            msg["value"] = None
            msg["is_observed"] = False


def predictive_draws(post, draws, key, var_name=None) -> tuple[np.ndarray, np.ndarray]:
    """Posterior-predictive draws ``(S, N, ...)`` of the observed site ``var_name`` and its observations.

    :param post: a :class:`~numpyro_pc.DualPosterior`.
    :param draws: unconstrained draws ``(S, d)`` of ``post``.
    """
    data = post.data
    spec = replace(post.spec, num_examples=int(data.per_example[0].shape[0]))
    values = jax.vmap(lambda z: constrain(spec, z, data))(jnp.asarray(draws))
    observed = trace_at(spec, post.state.mean, data.per_example, data.shared)
    return _predictive(spec, data, values, observed, key, var_name)


def _predictive(spec, data, values, observed, key, var_name) -> tuple[np.ndarray, np.ndarray]:
    """Predictive draws of ``var_name`` with the latent sites set to each of ``values`` (a dict of
    ``(S, ...)`` site values), and the observations read from the trace ``observed``. Local latents
    (docs/hierarchical.md) are not in ``values``: they are drawn from their prior given the globals,
    which is what the leave-one-unit-out predictive ``∫ p(y_i | z, u) p(u | z) du`` needs."""
    names = spec.observed
    var_name = var_name or names[0]
    if var_name not in names:
        raise InvalidOptionError(f"{var_name!r} is not an observed site of the data plate; found {names}")

    def one(value, k):
        args, kwargs = spec.build_args(data.per_example, data.shared)
        model = _Unobserve(handlers.seed(handlers.substitute(spec.model, data=value), k), [var_name])
        with handlers.block():
            return handlers.trace(model).get_trace(*args, **kwargs)[var_name]["value"]

    keys = jax.random.split(key, next(iter(values.values())).shape[0])
    y_hat = jax.lax.map(lambda a: one(*a), (values, keys), batch_size=16)
    return np.asarray(y_hat), np.asarray(observed[var_name]["value"])


def loo_pit(post, key, num_samples=1000, var_name=None) -> np.ndarray:
    r"""LOO probability integral transform of every observation with :func:`arviz.loo_pit`.

    :param post: a :class:`~numpyro_pc.DualPosterior` or :class:`~numpyro_pc.EFPosterior`
        that keeps its data (for the latter the weights are
        :math:`\log q_{\setminus i}/q = \langle g_i, T(x_s)\rangle + c_i`, exact too).
    :param key: a JAX PRNG key (posterior and predictive draws).
    :param int num_samples: posterior draws.
    :param str var_name: the observed site (default: the first in the data plate).
    :return: ``(N,)`` LOO-PIT values (uniform for a calibrated model).
    """
    import arviz as az

    k1, k2 = jax.random.split(key)
    y_hat, y, weights = _pit_inputs(post, k1, k2, int(num_samples), var_name)
    shape = y_hat.shape
    y_hat = y_hat.reshape(shape[0], shape[1], -1)[..., 0] if y_hat.ndim > 2 else y_hat
    return np.asarray(az.loo_pit(y=np.asarray(y).reshape(-1)[:shape[1]], y_hat=y_hat.T, log_weights=weights.T))


_pit_inputs = by_site_table("pc.loo_pit")


@_pit_inputs.register(Sites)
def _gaussian_pit_inputs(post, draw_key, predictive_key, num_samples, var_name) -> tuple[Any, Any, np.ndarray]:
    with jax.enable_x64(post.state.mean.dtype == jnp.float64):
        draws = post.sample_unconstrained(draw_key, num_samples)
        y_hat, y = predictive_draws(post, draws, predictive_key, var_name)
    return y_hat, y, loo_log_weights(post, draws)


@_pit_inputs.register(EFSiteTable)
def _ef_pit_inputs(post, draw_key, predictive_key, num_samples, var_name) -> tuple[Any, Any, np.ndarray]:
    spec, family, data = post.config.spec, post.family, post.data
    with jax.enable_x64(post.natural.dtype == jnp.float64):
        draws = family.sample(post.natural, draw_key, num_samples)
        raw = family.stats(draws) @ retained_grads(post).T  # ⟨g_i, T(x_s)⟩ of the retained examples, (S, N)
        weights = np.asarray(raw - logsumexp(raw, axis=0, keepdims=True))
        z, discrete, _ = model_point(spec, family, {k: v[0] for k, v in draws.items()})
        observed = trace_at(spec, z, data.per_example, data.shared, discrete)
        y_hat, y = _predictive(spec, data, family.to_constrained(draws), observed, predictive_key, var_name)
    return y_hat, y, weights
