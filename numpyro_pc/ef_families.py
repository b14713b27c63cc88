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

**Gauss rules.** Each scalar Beta or Gamma factor has a Gauss rule of its own
(:func:`beta_rule`, :func:`gamma_rule`). The nodes and weights of an ``n``-point rule are
the eigenvalues of the symmetric tridiagonal Jacobi matrix of the monic orthogonal
polynomials of the weight and the squared first components of its eigenvectors (Golub &
Welsch, 1969); the recurrences are closed-form in the shape parameters, so the rules are
computed inside ``jit`` from the current natural parameters. Gauss–Jacobi for
:math:`\mathrm{Beta}(a, b)` (weight :math:`(1-t)^{b-1}(1+t)^{a-1}` on :math:`[-1, 1]`,
:math:`x = (1+t)/2`), generalised Gauss–Laguerre for :math:`\mathrm{Gamma}(a, r)` (weight
:math:`t^{a-1}e^{-t}`, :math:`x = t/r`). The weights sum to one: a rule is a discrete
probability measure whose first ``2n-1`` moments equal the distribution's.

A :class:`ProductFamily` is a mean-field product over the model's latent sites; its natural
parameter is the concatenation of the factors'. This is the only module that tests which
concrete family or NumPyro distribution it holds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import gammaln
from numpyro.distributions import constraints

from .errors import InvalidOptionError, UnsupportedGuideError, UnsupportedModelError

__all__ = ["Factor", "BetaFactor", "GammaFactor", "DirichletFactor", "ProductFamily", "make_factor",
           "factor_from_distribution", "EF_FAMILIES", "golub_welsch", "beta_rule", "gamma_rule"]

_TINY = 1e-300


@dataclass(frozen=True)
class Factor(ABC):
    """One latent site's family. ``shape`` is the site's constrained value shape."""

    site: str
    shape: tuple

    family_name = ""
    support = None
    dist_args = ()  # names of the NumPyro distribution's arguments, in order

    @property
    def size(self):
        """Number of natural parameters."""
        return math.prod(self.shape) * 2

    @abstractmethod
    def stats(self, x):
        """Sufficient statistics ``T(x)``: ``(..., *shape)`` → ``(..., size)``."""

    @abstractmethod
    def log_normalizer(self, lam):
        """:math:`A(\\lambda)` (a scalar) of the flat natural parameter ``lam``."""

    @abstractmethod
    def in_domain(self, lam):
        """Whether every shape parameter is positive (a scalar boolean)."""

    @abstractmethod
    def to_args(self, lam):
        """The NumPyro distribution's arguments (a tuple of arrays of the site's shape)."""

    @abstractmethod
    def from_args(self, *args):
        """Flat natural parameter from the distribution's arguments."""

    @abstractmethod
    def sample(self, key, lam, num):
        """``num`` draws ``(num, *shape)``."""

    def distribution(self, lam):
        """The factor as a NumPyro distribution."""
        return self.dist_class(*self.to_args(lam))

    def default_natural(self, dtype):
        """A start: Beta(1, 1), Gamma(1, 1), Dirichlet(1)."""
        return self.from_args(*[jnp.ones(self.shape, dtype)] * len(self.dist_args))

    def rule(self, lam, num_nodes):
        """A Gauss rule ``(x (n, *shape), weights (n,))``, or ``None`` where the factor has none."""
        return None

    def mean(self, lam):
        """:math:`E_q[x]`."""
        return self.distribution(lam).mean


@dataclass(frozen=True)
class BetaFactor(Factor):
    family_name = "beta"
    support = constraints.unit_interval
    dist_args = ("concentration1", "concentration0")
    dist_class = dist.Beta

    def _ab(self, lam):
        pair = jnp.reshape(lam, self.shape + (2,))
        return pair[..., 0] + 1.0, pair[..., 1] + 1.0

    def stats(self, x):
        t = jnp.stack([jnp.log(jnp.maximum(x, _TINY)), jnp.log(jnp.maximum(1.0 - x, _TINY))], -1)
        return jnp.reshape(t, x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam):
        a, b = self._ab(lam)
        return jnp.sum(gammaln(a) + gammaln(b) - gammaln(a + b))

    def in_domain(self, lam):
        a, b = self._ab(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(a > 0) & jnp.all(b > 0)

    def to_args(self, lam):
        return self._ab(lam)

    def from_args(self, a, b):
        a, b = jnp.broadcast_to(a, self.shape), jnp.broadcast_to(b, self.shape)
        return jnp.reshape(jnp.stack([a - 1.0, b - 1.0], -1), (-1,))

    def sample(self, key, lam, num):
        a, b = self._ab(lam)
        x = jax.random.beta(key, a, b, (num,) + self.shape, dtype=lam.dtype)
        eps = jnp.finfo(lam.dtype).eps
        return jnp.clip(x, eps, 1.0 - eps)

    def rule(self, lam, num_nodes):
        if math.prod(self.shape) != 1:
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

    def _ar(self, lam):
        pair = jnp.reshape(lam, self.shape + (2,))
        return pair[..., 0] + 1.0, -pair[..., 1]

    def stats(self, x):
        t = jnp.stack([jnp.log(jnp.maximum(x, _TINY)), x], -1)
        return jnp.reshape(t, x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam):
        a, r = self._ar(lam)
        return jnp.sum(gammaln(a) - a * jnp.log(r))

    def in_domain(self, lam):
        a, r = self._ar(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(a > 0) & jnp.all(r > 0)

    def to_args(self, lam):
        return self._ar(lam)

    def from_args(self, a, r):
        a, r = jnp.broadcast_to(a, self.shape), jnp.broadcast_to(r, self.shape)
        return jnp.reshape(jnp.stack([a - 1.0, -r], -1), (-1,))

    def sample(self, key, lam, num):
        a, r = self._ar(lam)
        g = jax.random.gamma(key, a, (num,) + self.shape, dtype=lam.dtype)
        return jnp.maximum(g, jnp.finfo(lam.dtype).tiny) / r

    def rule(self, lam, num_nodes):
        if math.prod(self.shape) != 1:
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
    def size(self):
        return math.prod(self.shape)

    def stats(self, x):
        return jnp.log(jnp.maximum(x, _TINY))

    def log_normalizer(self, lam):
        alpha = lam + 1.0
        return jnp.sum(gammaln(alpha)) - gammaln(jnp.sum(alpha))

    def in_domain(self, lam):
        return jnp.all(jnp.isfinite(lam)) & jnp.all(lam + 1.0 > 0)

    def to_args(self, lam):
        return (lam + 1.0,)

    def from_args(self, alpha):
        return jnp.broadcast_to(alpha, self.shape) - 1.0

    def default_natural(self, dtype):
        return jnp.zeros(self.shape, dtype)

    def sample(self, key, lam, num):
        x = jax.random.dirichlet(key, lam + 1.0, (num,), dtype=lam.dtype)
        return jnp.maximum(x, jnp.finfo(lam.dtype).tiny)

    def mean(self, lam):
        alpha = lam + 1.0
        return alpha / jnp.sum(alpha)


EF_FAMILIES = {"beta": BetaFactor, "gamma": GammaFactor, "dirichlet": DirichletFactor}


def make_factor(family, site, shape, support):
    """The factor named ``family`` for latent ``site`` of constrained ``shape`` and prior ``support``.

    :raises InvalidOptionError: for an unknown family name.
    :raises UnsupportedModelError: when the site's support is not the family's, or a
        Dirichlet site is not one vector.
    """
    cls = EF_FAMILIES.get(str(family).lower())
    if cls is None:
        raise InvalidOptionError(f"family {family!r} for latent site {site!r} is not one of {sorted(EF_FAMILIES)} "
                                 "(Gaussian blocks mixed with these are not supported yet)")
    if support is not None and not _same_support(support, cls.support):
        raise UnsupportedModelError(f"latent site {site!r} has support {support} but family {family!r} needs "
                                    f"{cls.support}")
    if cls is DirichletFactor and len(shape) != 1:
        raise UnsupportedModelError(f"a Dirichlet factor is one simplex vector; latent site {site!r} has shape "
                                    f"{tuple(shape)}")
    return cls(site, tuple(shape))


def _same_support(a, b):
    while isinstance(a, constraints.independent):  # an element-wise factor over an expanded site
        a = a.base_constraint
    return type(a) is type(b) and str(a) == str(b)


def factor_from_distribution(site, fn):
    """``(factor, natural)`` of a guide's sample-site distribution ``fn``, and the names of
    its arguments (``Beta``, ``Gamma``, ``Dirichlet``).

    :raises UnsupportedGuideError: for any other distribution (LogNormal and Normal guides
        are Gaussians in unconstrained space: use an autoguide and the Gaussian path).
    """
    base, batch = fn, ()
    if isinstance(fn, dist.Independent):
        base = fn.base_dist
    table = ((dist.Beta, BetaFactor, ("concentration1", "concentration0")),
             (dist.Gamma, GammaFactor, ("concentration", "rate")),
             (dist.Dirichlet, DirichletFactor, ("concentration",)))
    for dist_cls, cls, names in table:
        if type(base) is dist_cls:
            shape = tuple(base.batch_shape) + tuple(base.event_shape)
            batch = tuple(base.batch_shape)
            if cls is DirichletFactor and batch:
                raise UnsupportedGuideError(f"guide site {site!r}: a batched Dirichlet (batch shape {batch}) is not "
                                            "supported; one simplex vector per site")
            factor = cls(site, shape)
            return factor, factor.from_args(*(getattr(base, n) for n in names)), names
    raise UnsupportedGuideError(
        f"guide site {site!r} samples from {type(base).__name__}; a hand-written exponential-family guide may use "
        f"Beta, Gamma or Dirichlet sites (a Normal/LogNormal guide is a Gaussian in unconstrained space: use "
        "AutoNormal or AutoDiagonalNormal and the Gaussian path)")


@dataclass(frozen=True)
class ProductFamily:
    r"""Mean-field product :math:`q(x) = \prod_k q_k(x_k)` over latent sites (trace order).

    The natural parameter, sufficient statistics and mean parameters are the
    concatenations of the factors'; :math:`A` and the entropy add up.
    """

    factors: tuple

    @cached_property
    def offsets(self):
        out, pos = [], 0
        for f in self.factors:
            out.append(pos)
            pos += f.size
        return tuple(out)

    @property
    def size(self):
        return sum(f.size for f in self.factors)

    @property
    def names(self):
        return tuple(f.site for f in self.factors)

    def split(self, lam):
        """The factors' natural parameters."""
        return [lam[..., o:o + f.size] for f, o in zip(self.factors, self.offsets)]

    def stats(self, values):
        """``T`` of a dict of site values with a leading batch axis → ``(S, P)``."""
        return jnp.concatenate([f.stats(values[f.site]) for f in self.factors], -1)

    def log_normalizer(self, lam):
        return sum(f.log_normalizer(p) for f, p in zip(self.factors, self.split(lam)))

    def expectation(self, lam):
        r"""Mean parameters :math:`\mu = \nabla A(\lambda) = E_q[T(x)]`."""
        return jax.grad(self.log_normalizer)(lam)

    def fisher(self, lam):
        r"""Fisher information :math:`F(\lambda) = \nabla^2 A(\lambda)` (block diagonal)."""
        return jax.hessian(self.log_normalizer)(lam)

    def in_domain(self, lam):
        ok = jnp.asarray(True)
        for f, p in zip(self.factors, self.split(lam)):
            ok = ok & f.in_domain(p)
        return ok

    def entropy(self, lam):
        r""":math:`H[q] = A(\lambda) - \langle \lambda, \mu \rangle` (Lebesgue base measure)."""
        return self.log_normalizer(lam) - jnp.dot(lam, self.expectation(lam))

    def kl(self, lam1, lam2):
        r""":math:`KL(q_1 \| q_2) = A(\lambda_2) - A(\lambda_1) - \langle \lambda_2 - \lambda_1, \mu_1 \rangle`."""
        return self.log_normalizer(lam2) - self.log_normalizer(lam1) - jnp.dot(lam2 - lam1, self.expectation(lam1))

    def log_prob(self, lam, values):
        """:math:`\\log q(x)` of a dict of site values (leading batch axis)."""
        return self.stats(values) @ lam - self.log_normalizer(lam)

    def from_expectation(self, mu, lam0, num_iters=60):
        r"""Natural parameters with :math:`\nabla A(\lambda) = \mu`: damped Newton on the convex
        :math:`A(\lambda) - \langle\lambda,\mu\rangle` from ``lam0``, each step halved until the
        shape parameters stay positive and the objective does not increase."""
        objective = lambda lam: self.log_normalizer(lam) - jnp.dot(lam, mu)  # noqa: E731
        steps = 0.5 ** jnp.arange(40, dtype=lam0.dtype)

        def body(_, lam):
            grad = self.expectation(lam) - mu
            direction = jnp.linalg.solve(self.fisher(lam), grad)
            cand = lam[None] - steps[:, None] * direction[None]
            inside = jax.vmap(self.in_domain)(cand)
            here = objective(lam)
            values = jax.vmap(objective)(jnp.where(inside[:, None], cand, lam[None]))
            ok = inside & (values <= here + 1e-12 * (1.0 + jnp.abs(here)))  # rounding near the optimum
            first = jnp.argmax(ok)
            return jnp.where(jnp.any(ok), cand[first], lam)

        return jax.lax.fori_loop(0, num_iters, body, lam0)

    def sample(self, key, lam, num):
        """A dict of ``num`` draws per site."""
        keys = jax.random.split(key, len(self.factors))
        return {f.site: f.sample(k, p, num) for f, k, p in zip(self.factors, keys, self.split(lam))}

    def mean(self, lam):
        return {f.site: f.mean(p) for f, p in zip(self.factors, self.split(lam))}

    def default_natural(self, dtype):
        return jnp.concatenate([jnp.reshape(f.default_natural(dtype), (-1,)) for f in self.factors])

    def has_rule(self):
        """Whether every factor has a 1-D Gauss rule (scalar Beta or Gamma sites)."""
        return all(type(f) in (BetaFactor, GammaFactor) and math.prod(f.shape) == 1 for f in self.factors)

    def tensor_rule(self, lam, num_nodes):
        """Tensor product of the factors' Gauss rules: ``(values dict (n^K, ...), weights (n^K,))``."""
        rules = [f.rule(p, num_nodes) for f, p in zip(self.factors, self.split(lam))]
        grids = jnp.meshgrid(*[jnp.arange(num_nodes)] * len(rules), indexing="ij")
        idx = [g.reshape(-1) for g in grids]
        values = {f.site: r[0][i] for f, r, i in zip(self.factors, rules, idx)}
        weights = jnp.prod(jnp.stack([r[1][i] for r, i in zip(rules, idx)]), 0)
        return values, weights

    def describe(self, lam):
        """Per site: the family and its distribution arguments (for messages and records)."""
        return {f.site: (f.family_name, {n: v for n, v in zip(f.dist_args, f.to_args(p))})
                for f, p in zip(self.factors, self.split(lam))}


# --------------------------------------------------------------------------- Gauss rules


def golub_welsch(diagonal, off_diagonal):
    """Nodes and probability weights of the Gauss rule of a Jacobi matrix.

    :param diagonal: ``(n,)`` recurrence coefficients ``a_0..a_{n-1}``.
    :param off_diagonal: ``(n-1,)`` values ``sqrt(b_1)..sqrt(b_{n-1})``.
    :return: ``(nodes, weights)``, each ``(n,)``, weights summing to one.
    """
    jac = jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)
    nodes, vectors = jnp.linalg.eigh(jac)
    weights = vectors[0] ** 2
    return nodes, weights / jnp.sum(weights)


def beta_rule(a, b, num_nodes):
    r"""``num_nodes``-point Gauss–Jacobi rule of :math:`\mathrm{Beta}(a, b)` on :math:`(0, 1)`.

    Recurrence of the monic Jacobi polynomials (:math:`s = 2k + \alpha + \beta`):
    :math:`a_k = (\beta^2-\alpha^2)/(s(s+2))` (:math:`a_0 = (\beta-\alpha)/(\alpha+\beta+2)`),
    :math:`b_k = 4k(k+\alpha)(k+\beta)(k+\alpha+\beta)/(s^2(s+1)(s-1))`
    (:math:`b_1 = 4(1+\alpha)(1+\beta)/((2+\alpha+\beta)^2(3+\alpha+\beta))`).

    :return: ``(x, weights)``.
    """
    a, b = jax.lax.stop_gradient(a), jax.lax.stop_gradient(b)
    alpha, beta = b - 1.0, a - 1.0
    k = jnp.arange(num_nodes, dtype=jnp.result_type(a, float))
    s = 2.0 * k + alpha + beta
    safe = jnp.where(k == 0, 1.0, s * (s + 2.0))
    diag = jnp.where(k == 0, (beta - alpha) / (alpha + beta + 2.0), (beta**2 - alpha**2) / safe)
    kk = k[1:]
    ss = s[1:]
    general = 4.0 * kk * (kk + alpha) * (kk + beta) * (kk + alpha + beta) / (
        ss**2 * (ss + 1.0) * jnp.where(kk == 1, 1.0, ss - 1.0))
    first = 4.0 * (1.0 + alpha) * (1.0 + beta) / ((2.0 + alpha + beta) ** 2 * (3.0 + alpha + beta))
    off = jnp.sqrt(jnp.where(kk == 1, first, general))
    t, w = golub_welsch(diag, off)
    t = jnp.clip(t, -1.0, 1.0)
    return 0.5 * (1.0 + t), w


def gamma_rule(a, rate, num_nodes):
    r"""``num_nodes``-point generalised Gauss–Laguerre rule of :math:`\mathrm{Gamma}(a, r)`.

    Recurrence: :math:`a_k = 2k + \alpha + 1`, :math:`b_k = k(k + \alpha)`, :math:`\alpha = a - 1`.

    :return: ``(x, weights)``.
    """
    a, rate = jax.lax.stop_gradient(a), jax.lax.stop_gradient(rate)
    alpha = a - 1.0
    k = jnp.arange(num_nodes, dtype=jnp.result_type(a, float))
    diag = 2.0 * k + alpha + 1.0
    off = jnp.sqrt(k[1:] * (k[1:] + alpha))
    t, w = golub_welsch(diag, off)
    return jnp.maximum(t, jnp.finfo(t.dtype).tiny) / rate, w
