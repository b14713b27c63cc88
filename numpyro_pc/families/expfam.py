r"""Non-Gaussian exponential families over constrained latents: Beta, Gamma, Dirichlet.

Each factor is a minimal exponential family with respect to Lebesgue measure on its
support (paper §2, eq. ``qdualform``):

.. math::

    q(x) = \exp(\langle \lambda, T(x) \rangle - A(\lambda)),

=========  ===================  ===========================  ==================================
family     support              :math:`T(x)`                 :math:`\lambda`
=========  ===================  ===========================  ==================================
Beta       :math:`(0, 1)`       :math:`(\log x, \log(1-x))`  :math:`(a-1, b-1)`
Gamma      :math:`(0, \infty)`  :math:`(\log x, x)`          :math:`(a-1, -r)` (rate :math:`r`)
Dirichlet  simplex              :math:`\log x`               :math:`\alpha - 1`
=========  ===================  ===========================  ==================================

The base measure is constant, so the entropy is :math:`A(\lambda) - \langle\lambda, \mu\rangle`
and a prior of the same family is a prior *site* :math:`\lambda_0` exactly (the paper's
appendix on non-constant base measures is then not needed). Mean (expectation) parameters
are :math:`\mu = \nabla A(\lambda)`, the Fisher information is :math:`\nabla^2 A(\lambda)`.
Beta and Gamma factors apply element-wise to a latent of any shape; a Dirichlet factor is
one simplex vector.

Every factor says how it is integrated (:meth:`Factor.rule`, a deterministic Gauss rule of
:mod:`numpyro_pc.families.point_sets` for scalar sites, or fixed draws) and which space it lives in:
these factors live on the constrained values, the Gaussian factors of
:mod:`numpyro_pc.families.expfam_gaussian` on the unconstrained ones, the discrete factors of
:mod:`numpyro_pc.families.discrete` on the support itself. Products over a model's latent sites
are assembled in :mod:`numpyro_pc.families.product`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import gammaln
from numpyro.distributions import constraints

from .point_sets import beta_rule, gamma_rule
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from typing import Any

__all__ = ["Factor", "BetaFactor", "GammaFactor", "DirichletFactor"]

_TINY = 1e-300


@dataclass(frozen=True)
class Factor(ABC):
    """One latent site's family. ``shape`` is the site's constrained value shape."""

    site: str
    shape: tuple

    family_name = ""
    support = None
    space = "constrained"  # the values the factor is a density of
    dist_class: ClassVar[type[dist.Distribution]]  # set by each concrete factor
    dist_args: ClassVar[tuple[str, ...]] = ()  # names of the NumPyro distribution's arguments, in order

    @property
    def size(self) -> int:
        """Number of natural parameters."""
        return math.prod(self.shape) * 2

    @abstractmethod
    def stats(self, x) -> jax.Array:
        """Sufficient statistics ``T(x)``: ``(..., *shape)`` → ``(..., size)``."""

    @abstractmethod
    def log_normalizer(self, lam) -> jax.Array:
        """:math:`A(\\lambda)` (a scalar) of the flat natural parameter ``lam``."""

    @abstractmethod
    def in_domain(self, lam) -> jax.Array:
        """Whether every shape parameter is positive (a scalar boolean)."""

    @abstractmethod
    def to_args(self, lam) -> tuple[jax.Array, ...]:
        """The NumPyro distribution's arguments (a tuple of arrays of the site's shape)."""

    @abstractmethod
    def from_args(self, *args) -> jax.Array:
        """Flat natural parameter from the distribution's arguments."""

    @abstractmethod
    def sample(self, key, lam, num) -> jax.Array:
        """``num`` draws ``(num, *shape)``."""

    def distribution(self, lam) -> dist.Distribution:
        """The factor as a NumPyro distribution."""
        return self.dist_class(*self.to_args(lam))

    def default_natural(self, dtype) -> jax.Array:
        """A start: Beta(1, 1), Gamma(1, 1), Dirichlet(1)."""
        return self.from_args(*[jnp.ones(self.shape, dtype)] * len(self.dist_args))

    def rule(self, lam, num_nodes) -> tuple[jax.Array, jax.Array] | None:
        """A deterministic rule ``(x (n, *shape), weights (n,))``, or ``None`` where the factor has none."""
        return None

    def rule_size(self, num_nodes) -> int | None:
        """Number of points of :meth:`rule` (``None`` where the factor has no rule)."""
        return num_nodes if self.has_rule else None

    @property
    def has_rule(self) -> bool:
        """Whether :meth:`rule` gives points (scalar Beta, Gamma and Normal sites, discrete sites)."""
        return False

    def design_draws(self, key, lam, num) -> jax.Array:
        """``num`` points standing for the factor when it has no rule (default: plain draws)."""
        return self.sample(key, lam, num)

    def mean(self, lam) -> jax.Array:
        """:math:`E_q[x]` of the constrained value."""
        return self.distribution(lam).mean

    def to_constrained(self, values) -> jax.Array:
        """The latent site's constrained values from the factor's own coordinates."""
        return values

    def from_constrained(self, values) -> jax.Array:
        """The factor's own coordinates of the latent site's constrained values."""
        return values


@dataclass(frozen=True)
class BetaFactor(Factor):
    family_name = "beta"
    support = constraints.unit_interval
    dist_args = ("concentration1", "concentration0")
    dist_class = dist.Beta

    def _ab(self, lam) -> tuple[jax.Array, jax.Array]:
        pair = jnp.reshape(lam, self.shape + (2,))
        return pair[..., 0] + 1.0, pair[..., 1] + 1.0

    def stats(self, x) -> jax.Array:
        t = jnp.stack([jnp.log(jnp.maximum(x, _TINY)), jnp.log(jnp.maximum(1.0 - x, _TINY))], -1)
        return jnp.reshape(t, x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam) -> jax.Array:
        a, b = self._ab(lam)
        return jnp.sum(gammaln(a) + gammaln(b) - gammaln(a + b))

    def in_domain(self, lam) -> jax.Array:
        a, b = self._ab(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(a > 0) & jnp.all(b > 0)

    def to_args(self, lam) -> tuple[jax.Array, jax.Array]:
        return self._ab(lam)

    def from_args(self, a, b) -> jax.Array:
        a, b = jnp.broadcast_to(a, self.shape), jnp.broadcast_to(b, self.shape)
        return jnp.reshape(jnp.stack([a - 1.0, b - 1.0], -1), (-1,))

    def sample(self, key, lam, num) -> jax.Array:
        a, b = self._ab(lam)
        x = jax.random.beta(key, a, b, (num,) + self.shape, dtype=lam.dtype)
        eps = jnp.finfo(lam.dtype).eps
        return jnp.clip(x, eps, 1.0 - eps)

    @property
    def has_rule(self) -> bool:
        return math.prod(self.shape) == 1

    def rule(self, lam, num_nodes) -> tuple[jax.Array, Any] | None:
        if not self.has_rule:
            return None
        a, b = self._ab(lam)
        x, w = beta_rule(jnp.reshape(a, ()), jnp.reshape(b, ()), num_nodes)
        return jnp.reshape(x, (num_nodes,) + self.shape), w


@dataclass(frozen=True)
class GammaFactor(Factor):
    family_name = "gamma"
    support = constraints.positive
    dist_args = ("concentration", "rate")
    dist_class = dist.Gamma

    def _ar(self, lam) -> tuple[jax.Array, jax.Array]:
        pair = jnp.reshape(lam, self.shape + (2,))
        return pair[..., 0] + 1.0, -pair[..., 1]

    def stats(self, x) -> jax.Array:
        t = jnp.stack([jnp.log(jnp.maximum(x, _TINY)), x], -1)
        return jnp.reshape(t, x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam) -> jax.Array:
        a, r = self._ar(lam)
        return jnp.sum(gammaln(a) - a * jnp.log(r))

    def in_domain(self, lam) -> jax.Array:
        a, r = self._ar(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(a > 0) & jnp.all(r > 0)

    def to_args(self, lam) -> tuple[jax.Array, jax.Array]:
        return self._ar(lam)

    def from_args(self, a, r) -> jax.Array:
        a, r = jnp.broadcast_to(a, self.shape), jnp.broadcast_to(r, self.shape)
        return jnp.reshape(jnp.stack([a - 1.0, -r], -1), (-1,))

    def sample(self, key, lam, num) -> jax.Array:
        a, r = self._ar(lam)
        g = jax.random.gamma(key, a, (num,) + self.shape, dtype=lam.dtype)
        return jnp.maximum(g, jnp.finfo(lam.dtype).tiny) / r

    @property
    def has_rule(self) -> bool:
        return math.prod(self.shape) == 1

    def rule(self, lam, num_nodes) -> tuple[jax.Array, Any] | None:
        if not self.has_rule:
            return None
        a, r = self._ar(lam)
        x, w = gamma_rule(jnp.reshape(a, ()), jnp.reshape(r, ()), num_nodes)
        return jnp.reshape(x, (num_nodes,) + self.shape), w


@dataclass(frozen=True)
class DirichletFactor(Factor):
    family_name = "dirichlet"
    support = constraints.simplex
    dist_args = ("concentration",)
    dist_class = dist.Dirichlet

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def stats(self, x) -> jax.Array:
        return jnp.log(jnp.maximum(x, _TINY))

    def log_normalizer(self, lam) -> jax.Array:
        alpha = lam + 1.0
        return jnp.sum(gammaln(alpha)) - gammaln(jnp.sum(alpha))

    def in_domain(self, lam) -> jax.Array:
        return jnp.all(jnp.isfinite(lam)) & jnp.all(lam + 1.0 > 0)

    def to_args(self, lam) -> tuple[Any]:
        return (lam + 1.0,)

    def from_args(self, alpha) -> jax.Array:
        return jnp.broadcast_to(alpha, self.shape) - 1.0

    def default_natural(self, dtype) -> jax.Array:
        return jnp.zeros(self.shape, dtype)

    def sample(self, key, lam, num) -> jax.Array:
        x = jax.random.dirichlet(key, lam + 1.0, (num,), dtype=lam.dtype)
        return jnp.maximum(x, jnp.finfo(lam.dtype).tiny)

    def mean(self, lam) -> jax.Array:
        alpha = lam + 1.0
        return alpha / jnp.sum(alpha)
