r"""Discrete factors of a mean-field product: Bernoulli and Categorical latents.

Both are minimal exponential families with respect to counting measure:

=============  ====================================  =====================================================
factor         :math:`T(z)`                          :math:`\lambda`
=============  ====================================  =====================================================
Bernoulli      :math:`z` per element                 :math:`\operatorname{logit} p`
Categorical    :math:`(1[z = k])_{k < K-1}`          :math:`(\log \pi_k - \log \pi_{K-1})_{k < K-1}`
=============  ====================================  =====================================================

so :math:`A(\lambda) = \sum \log(1 + e^{\lambda})` and
:math:`\log(1 + \sum_k e^{\lambda_k})`. Every function of a scalar discrete latent is
linear in its one-hot statistics, so :math:`E_q[\ell_i]` is linear in the mean parameters
:math:`\mu = \pi` and the site :math:`g_i = \nabla_\mu E_q[\ell_i]` is an exact sum over the
support: :math:`g_{i,k} = E_q[\ell_i \mid z = k] - E_q[\ell_i \mid z = K-1]`. The factor's
rule is that enumeration — every value of the support with weight :math:`q(z)` — so the
regression of :mod:`numpyro_pc.sites.expfam` returns these sums exactly. A Bernoulli site with
several elements enumerates the :math:`2^n` joint values (up to ``MAX_ENUMERATION``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.nn import log_sigmoid, softplus
from jax.scipy.special import logsumexp
from numpyro.distributions import constraints

from .expfam import Factor

__all__ = ["BernoulliFactor", "CategoricalFactor", "MAX_ENUMERATION"]

MAX_ENUMERATION = 4096


@dataclass(frozen=True)
class BernoulliFactor(Factor):
    """Independent Bernoulli factors, one per element of the site (``dist.Bernoulli(probs=...)``)."""

    family_name = "bernoulli"
    space = "discrete"
    support = constraints.boolean
    dist_args = ("probs",)
    dist_class = dist.BernoulliProbs

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def stats(self, x) -> jax.Array:
        return jnp.reshape(jnp.asarray(x, jnp.result_type(float)), x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam) -> jax.Array:
        return jnp.sum(softplus(lam))

    def in_domain(self, lam) -> jax.Array:
        return jnp.all(jnp.isfinite(lam))

    def to_args(self, lam) -> tuple[jax.Array]:
        return (jnp.reshape(jax.nn.sigmoid(lam), self.shape),)

    def from_args(self, probs) -> jax.Array:
        p = jnp.reshape(jnp.broadcast_to(probs, self.shape), (-1,))
        return jnp.log(p) - jnp.log1p(-p)

    def default_natural(self, dtype) -> jax.Array:
        return jnp.zeros((self.size,), dtype)

    def distribution(self, lam) -> dist.Distribution:
        return dist.Bernoulli(logits=jnp.reshape(lam, self.shape))

    def sample(self, key, lam, num) -> jax.Array:
        draws = jax.random.bernoulli(key, jax.nn.sigmoid(lam), (num, self.size))
        return jnp.reshape(draws.astype(jnp.int32), (num,) + self.shape)

    def mean(self, lam) -> jax.Array:
        return jnp.reshape(jax.nn.sigmoid(lam), self.shape)

    @property
    def has_rule(self) -> bool:
        return 2 ** self.size <= MAX_ENUMERATION

    def rule_size(self, num_nodes) -> int | None:
        return 2 ** self.size if self.has_rule else None

    def rule(self, lam, num_nodes) -> tuple[jax.Array, jax.Array] | None:
        if not self.has_rule:
            return None
        table = np.array(list(itertools.product((0, 1), repeat=self.size)), np.int32)
        logw = jnp.asarray(table, lam.dtype) @ log_sigmoid(lam) + jnp.asarray(1 - table, lam.dtype) @ log_sigmoid(-lam)
        return jnp.reshape(jnp.asarray(table), (table.shape[0],) + self.shape), jnp.exp(logw)


@dataclass(frozen=True)
class CategoricalFactor(Factor):
    """One categorical latent with ``num_categories`` values ``0..K-1`` (``dist.Categorical(probs=...)``)."""

    num_categories: int = 2

    family_name = "categorical"
    space = "discrete"
    dist_args = ("probs",)
    dist_class = dist.CategoricalProbs

    @property
    def support(self):
        return constraints.integer_interval(0, self.num_categories - 1)

    @property
    def size(self) -> int:
        return self.num_categories - 1

    def stats(self, x) -> jax.Array:
        return jax.nn.one_hot(x, self.num_categories, dtype=jnp.result_type(float))[..., :-1]

    def _logits(self, lam) -> jax.Array:
        return jnp.concatenate([lam, jnp.zeros((1,), lam.dtype)])

    def log_normalizer(self, lam) -> jax.Array:
        return logsumexp(self._logits(lam))

    def in_domain(self, lam) -> jax.Array:
        return jnp.all(jnp.isfinite(lam))

    def to_args(self, lam) -> tuple[jax.Array]:
        return (jax.nn.softmax(self._logits(lam)),)

    def from_args(self, probs) -> jax.Array:
        logp = jnp.log(jnp.asarray(probs))
        return logp[:-1] - logp[-1]

    def default_natural(self, dtype) -> jax.Array:
        return jnp.zeros((self.size,), dtype)

    def distribution(self, lam) -> dist.Distribution:
        return dist.Categorical(logits=self._logits(lam))

    def sample(self, key, lam, num) -> jax.Array:
        return jax.random.categorical(key, self._logits(lam), shape=(num,)).astype(jnp.int32)

    def mean(self, lam) -> jax.Array:
        """The category probabilities (the mean of the one-hot vector)."""
        return jax.nn.softmax(self._logits(lam))

    @property
    def has_rule(self) -> bool:
        return True

    def rule_size(self, num_nodes) -> int | None:
        return self.num_categories

    def rule(self, lam, num_nodes) -> tuple[jax.Array, jax.Array]:
        return jnp.arange(self.num_categories, dtype=jnp.int32), jax.nn.softmax(self._logits(lam))
