r"""Gaussian factors of a mean-field product, over a latent site's unconstrained coordinates.

A Gaussian factor lives where NumPyro's Gaussian autoguides live: on the unconstrained value
:math:`u = T^{-1}(x)` of its site (a Normal factor on a positive site is a LogNormal, on a
unit-interval site a logit-normal). In natural parameters (paper §2, Table 1):

==============  =================================  =============================================
factor          :math:`T(u)`                       :math:`\lambda`
==============  =================================  =============================================
``"normal"``    :math:`(u_j, u_j^2)` per element   :math:`(m_j/s_j^2,\ -1/(2 s_j^2))`
``"full"``      :math:`(u,\ u_j u_k)_{j\le k}`     :math:`(S m,\ c)`, :math:`c_{jj} = -\tfrac12 S_{jj}`, :math:`c_{jk} = -S_{jk}`
==============  =================================  =============================================

with :math:`S` the precision, so :math:`\langle c, T_2(u)\rangle = -\tfrac12 u^\top S u`. The
site of a loss is linear in :math:`T`: a constant plus linear plus quadratic form in
:math:`u` — the Gaussian site of the dual form, here estimated by the same regression as the
other factors (:mod:`numpyro_pc.sites.expfam`). A scalar site is integrated by Gauss–Hermite
(:func:`numpyro_pc.families.point_sets.hermite_rule`); a vector site by moment-matched draws
(:func:`numpyro_pc.families.point_sets.whitened_normal`) or, in a product with Gauss-ruled factors, the
degree-3 symmetric cubature (:func:`numpyro_pc.families.point_sets.symmetric_cubature`), both of which
make every quadratic loss — the conjugate Gaussian case — exact.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform

from .expfam import Factor
from .point_sets import hermite_rule, whitened_normal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["NormalFactor", "FullGaussianFactor"]

_LOG_2PI = math.log(2.0 * math.pi)


@dataclass(frozen=True)
class _GaussianFactor(Factor):
    """Shared parts: ``shape`` is the unconstrained shape, ``transform`` the site's bijection."""

    transform: object = field(default_factory=IdentityTransform, compare=False, hash=False, repr=False)

    space = "unconstrained"
    support = None

    @property
    def dim(self) -> int:
        return math.prod(self.shape)

    @property
    def is_identity(self) -> bool:
        """Whether the site is real, so the factor is a density of the site's value itself."""
        transform = self.transform
        while isinstance(transform, IndependentTransform):
            transform = transform.base_transform
        return isinstance(transform, IdentityTransform)

    def to_constrained(self, values) -> jax.Array:
        return self.transform(values)

    def from_constrained(self, values) -> jax.Array:
        return jnp.reshape(self.transform.inv(values), self.shape)

    def _wrap(self, base) -> dist.Distribution:
        if self.is_identity:
            return base
        event = self.transform.domain.event_dim - len(base.event_shape)
        return dist.TransformedDistribution(base.to_event(event) if event > 0 else base, self.transform)

    def mean(self, lam) -> jax.Array:
        loc, _ = self._moments(lam)
        if self.is_identity:
            return jnp.reshape(loc, self.shape)
        draws = self.design_draws(jax.random.PRNGKey(0), lam, max(4096, 4 * self.dim + 1))
        return jnp.mean(self.transform(draws), 0)

    def default_natural(self, dtype) -> jax.Array:
        return self.from_args(jnp.zeros(self.shape, dtype), *self._unit_scale(dtype))

    @property
    def has_rule(self) -> bool:
        """A scalar site has the Gauss–Hermite rule."""
        return self.dim == 1

    def rule(self, lam, num_nodes) -> tuple[jax.Array, Any] | None:
        if not self.has_rule:
            return None
        loc, scale = self.to_args(lam)  # (loc, scale) or (loc, scale_tril): both the sd when d = 1
        x, w = hermite_rule(jnp.reshape(loc, ()), jnp.reshape(scale, ()), num_nodes)
        return jnp.reshape(x, (num_nodes,) + self.shape), w

    @abstractmethod
    def score(self, lam, values) -> jax.Array:
        r""":math:`-\nabla_u \log q(u) = S (u - m)` at ``values`` ``(num, *shape)``, flat ``(num, dim)``:
        Stein's identity :math:`E_q[\nabla^2\ell] = E_q[\nabla\ell\,(S(u-m))^\top]` turns gradients
        at the points into the expected Hessian."""

    @abstractmethod
    def from_whitened(self, lam, eps) -> jax.Array:
        """The values ``m + L ε`` (``L Lᵀ`` the covariance) of whitened points ``eps`` ``(num, dim)``:
        draws, or the points of a cubature rule."""

    def design_draws(self, key, lam, num) -> jax.Array:
        """Moment-matched draws (:func:`numpyro_pc.families.point_sets.whitened_normal`) mapped by :meth:`from_whitened`."""
        return self.from_whitened(lam, whitened_normal(key, num, self.dim, lam.dtype))

    def _flat_mean(self, lam) -> jax.Array:
        return jnp.reshape(self._moments(lam)[0], (-1,))


@dataclass(frozen=True)
class NormalFactor(_GaussianFactor):
    """Independent Normal factors, one per element of the site (``dist.Normal``, ``dist.LogNormal``,
    AutoNormal's sites)."""

    family_name = "normal"
    dist_args = ("loc", "scale")
    dist_class = dist.Normal

    def _pairs(self, lam) -> tuple[jax.Array, jax.Array]:
        pair = jnp.reshape(lam, self.shape + (2,))
        return pair[..., 0], pair[..., 1]

    def _moments(self, lam) -> tuple[Any, jax.Array]:
        eta1, eta2 = self._pairs(lam)
        return -eta1 / (2.0 * eta2), jnp.sqrt(-0.5 / eta2)

    def _unit_scale(self, dtype) -> tuple[jax.Array]:
        return (jnp.ones(self.shape, dtype),)

    def stats(self, x) -> jax.Array:
        return jnp.reshape(jnp.stack([x, x * x], -1), x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam) -> jax.Array:
        eta1, eta2 = self._pairs(lam)
        return jnp.sum(-eta1**2 / (4.0 * eta2) - 0.5 * jnp.log(-2.0 * eta2) + 0.5 * _LOG_2PI)

    def in_domain(self, lam) -> jax.Array:
        _, eta2 = self._pairs(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(eta2 < 0)

    def to_args(self, lam) -> tuple[Any, jax.Array]:
        return self._moments(lam)

    def from_args(self, loc, scale) -> jax.Array:
        loc, scale = jnp.broadcast_to(loc, self.shape), jnp.broadcast_to(scale, self.shape)
        prec = 1.0 / scale**2
        return jnp.reshape(jnp.stack([loc * prec, -0.5 * prec], -1), (-1,))

    def distribution(self, lam) -> dist.Distribution:
        return self._wrap(dist.Normal(*self._moments(lam)))

    def site_from_moments(self, lam, grad_mean, hess_mean) -> jax.Array:
        r"""Sites in natural coordinates from :math:`E[\nabla\ell]` ``(..., d)`` and
        :math:`E[\nabla^2\ell]` ``(..., d, d)``: per element
        :math:`(\bar g_j - \bar H_{jj} m_j,\ \tfrac12 \bar H_{jj})` (only the diagonal of the
        Hessian enters a mean-field factor)."""
        diag = jnp.diagonal(hess_mean, axis1=-2, axis2=-1)
        pair = jnp.stack([grad_mean - diag * self._flat_mean(lam), 0.5 * diag], -1)
        return jnp.reshape(pair, pair.shape[:-2] + (-1,))

    def sample(self, key, lam, num) -> jax.Array:
        loc, scale = self._moments(lam)
        return loc + scale * jax.random.normal(key, (num,) + self.shape, lam.dtype)

    def from_whitened(self, lam, eps) -> jax.Array:
        loc, scale = self._moments(lam)
        return loc + scale * jnp.reshape(eps, (eps.shape[0],) + self.shape)

    def score(self, lam, values) -> jax.Array:
        loc, scale = self._moments(lam)
        return jnp.reshape((values - loc) / scale**2, (values.shape[0], -1))


@dataclass(frozen=True)
class FullGaussianFactor(_GaussianFactor):
    """One multivariate Normal over all of the site's unconstrained coordinates
    (``dist.MultivariateNormal(loc, scale_tril=...)``)."""

    family_name = "full"
    dist_args = ("loc", "scale_tril")
    dist_class = dist.MultivariateNormal

    @property
    def size(self) -> int:
        return self.dim + self.dim * (self.dim + 1) // 2

    def _upper(self) -> tuple[jax.Array, jax.Array]:
        return jnp.triu_indices(self.dim)

    def precision(self, lam) -> jax.Array:
        """:math:`S` from the natural parameter."""
        d = self.dim
        upper = jnp.zeros((d, d), lam.dtype).at[self._upper()].set(lam[d:])
        return -(upper + upper.T)

    def _moments(self, lam) -> tuple[jax.Array, jax.Array]:
        chol = jnp.linalg.cholesky(self.precision(lam))
        loc = jax.scipy.linalg.cho_solve((chol, True), lam[:self.dim])
        return loc, chol

    def _unit_scale(self, dtype) -> tuple[jax.Array]:
        return (jnp.eye(self.dim, dtype=dtype),)

    def stats(self, x) -> jax.Array:
        batch = x.shape[:x.ndim - len(self.shape)]
        flat = jnp.reshape(x, batch + (self.dim,))
        rows, cols = self._upper()
        return jnp.concatenate([flat, flat[..., rows] * flat[..., cols]], -1)

    def log_normalizer(self, lam) -> jax.Array:
        loc, chol = self._moments(lam)
        return 0.5 * jnp.dot(lam[:self.dim], loc) - jnp.sum(jnp.log(jnp.diag(chol))) + 0.5 * self.dim * _LOG_2PI

    def in_domain(self, lam) -> jax.Array:
        chol = jnp.linalg.cholesky(self.precision(lam))
        return jnp.all(jnp.isfinite(lam)) & jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diag(chol) > 0)

    def to_args(self, lam) -> tuple[jax.Array, jax.Array]:
        """``(loc, scale_tril)`` of the covariance :math:`S^{-1}`."""
        loc, chol = self._moments(lam)
        eye = jnp.eye(self.dim, dtype=lam.dtype)
        cov = jax.scipy.linalg.cho_solve((chol, True), eye)
        return jnp.reshape(loc, self.shape), jnp.linalg.cholesky(0.5 * (cov + cov.T))

    def from_args(self, loc, scale_tril) -> jax.Array:
        eye = jnp.eye(self.dim, dtype=jnp.result_type(scale_tril))
        inv_tril = jax.scipy.linalg.solve_triangular(scale_tril, eye, lower=True)
        prec = inv_tril.T @ inv_tril
        rows, cols = self._upper()
        coef = jnp.where(rows == cols, -0.5, -1.0) * prec[rows, cols]
        return jnp.concatenate([prec @ jnp.reshape(loc, (-1,)), coef])

    def site_from_moments(self, lam, grad_mean, hess_mean) -> jax.Array:
        r"""Sites in natural coordinates from :math:`E[\nabla\ell]` ``(..., d)`` and
        :math:`E[\nabla^2\ell]` ``(..., d, d)``: :math:`\bar g - \bar H m` on :math:`u`, then
        :math:`\tfrac12\bar H_{jj}` on :math:`u_j^2` and :math:`\bar H_{jk}` on :math:`u_j u_k`."""
        rows, cols = self._upper()
        sym = 0.5 * (hess_mean + jnp.swapaxes(hess_mean, -1, -2))
        quad = jnp.where(rows == cols, 0.5, 1.0) * sym[..., rows, cols]
        return jnp.concatenate([grad_mean - sym @ self._flat_mean(lam), quad], -1)

    def distribution(self, lam) -> dist.Distribution:
        loc, tril = self.to_args(lam)
        return self._wrap(dist.MultivariateNormal(jnp.reshape(loc, (-1,)), scale_tril=tril))

    def score(self, lam, values) -> jax.Array:
        loc = self._flat_mean(lam)
        return (jnp.reshape(values, (values.shape[0], -1)) - loc) @ self.precision(lam)

    def from_whitened(self, lam, eps) -> jax.Array:
        loc, tril = self.to_args(lam)
        num = eps.shape[0]
        return jnp.reshape(jnp.reshape(loc, (-1,)) + eps @ tril.T, (num,) + self.shape)

    def sample(self, key, lam, num) -> jax.Array:
        return self.from_whitened(lam, jax.random.normal(key, (num, self.dim), lam.dtype))

