r"""Mean-field products of exponential-family factors over a model's latent sites.

:math:`q(x) = \prod_k q_k(x_k)`, one factor per latent site, in the model's trace order. The
natural parameter, sufficient statistics and mean parameters are the concatenations of the
factors'; :math:`A` and the entropy add up. The factors are registered by name
(:data:`EF_FAMILIES`): Beta, Gamma, Dirichlet (:mod:`numpyro_pc.families.expfam`), Normal and
full Gaussian blocks (:mod:`numpyro_pc.families.expfam_gaussian`), Bernoulli and Categorical
(:mod:`numpyro_pc.families.discrete`). This module and the factor modules are the only ones that
test which concrete factor or NumPyro distribution they hold.

**Design.** The points standing for :math:`q` in the site regression are a product
measure: the tensor product of the rules of the factors that have one (scalar Beta, Gamma,
Normal and discrete sites) times one set of fixed draws shared by the factors that have
none (vector sites). Under a product measure the sample covariance of :math:`T` is block
diagonal exactly, so each factor's regression coefficient depends only on the other
factors' *marginal* rules — which is what makes mean-field fixed points such as the
Normal–Gamma one exact (docs/expfam.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import ExpTransform, IdentityTransform, IndependentTransform, biject_to

from numpyro_pc.errors import InvalidOptionError, UnsupportedGuideError, UnsupportedModelError
from numpyro_pc.model.likelihood import trace_at
from numpyro_pc.protocols.capabilities import FixedPrecision, GaussianSolver, SiteCurvature, SiteDivision, SiteSum
from numpyro_pc.protocols.family import Family

from .discrete import BernoulliFactor, CategoricalFactor
from .expfam import BetaFactor, DirichletFactor, Factor, GammaFactor
from .expfam_gaussian import FullGaussianFactor, NormalFactor
from .point_sets import symmetric_cubature
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["ProductFamily", "EF_FAMILIES", "register_factor", "make_factor", "factor_from_distribution",
           "unwrap_distribution", "family_for_model", "site_names", "site_supports", "site_shape"]

EF_FAMILIES = {"beta": BetaFactor, "gamma": GammaFactor, "dirichlet": DirichletFactor, "normal": NormalFactor,
               "lognormal": NormalFactor, "full": FullGaussianFactor, "mvn": FullGaussianFactor,
               "bernoulli": BernoulliFactor, "categorical": CategoricalFactor}


def make_factor(family, site, shape, support) -> Factor:
    """The factor named ``family`` for latent ``site`` of constrained ``shape`` and prior ``support``.

    ``"normal"`` and ``"full"`` live on the site's unconstrained coordinates (any continuous
    support); ``"lognormal"`` is ``"normal"`` on a positive site.

    :raises InvalidOptionError: for an unknown family name.
    :raises UnsupportedModelError: when the site's support does not suit the family.
    """
    name = str(family).lower()
    cls = EF_FAMILIES.get(name)
    if cls is None:
        raise InvalidOptionError(f"family {family!r} for latent site {site!r} is not one of {sorted(EF_FAMILIES)} "
                                 "(a factor of your own: numpyro_pc.register_factor, before fitting or loading)")
    shape = tuple(shape)
    discrete = support is not None and support.is_discrete
    if cls.space == "discrete" and not discrete:
        raise UnsupportedModelError(f"family {family!r} is discrete but latent site {site!r} has support {support}")
    if cls.space != "discrete" and discrete:
        raise UnsupportedModelError(f"latent site {site!r} is discrete (support {support}); use family 'bernoulli' "
                                    f"or 'categorical', not {family!r}")
    if cls.space == "unconstrained":
        transform = biject_to(support) if support is not None else IdentityTransform()
        if name == "lognormal" and not isinstance(transform, ExpTransform):
            raise UnsupportedModelError(f"family 'lognormal' needs a positive latent site; {site!r} has support "
                                        f"{support} (use 'normal', a Gaussian on its unconstrained value)")
        return cls(site, tuple(transform.inverse_shape(shape)), transform)
    if cls is CategoricalFactor:
        base = _base_constraint(support)
        if not isinstance(base, constraints.integer_interval) or float(base.lower_bound) != 0.0 or shape:
            raise UnsupportedModelError(f"a categorical factor is one latent with values 0..K-1; site {site!r} has "
                                        f"support {support} and shape {shape}")
        return cls(site, (), int(base.upper_bound) + 1)
    if support is not None and not _same_support(support, cls.support):
        raise UnsupportedModelError(f"latent site {site!r} has support {support} but family {family!r} needs "
                                    f"{cls.support}")
    if cls is DirichletFactor and len(shape) != 1:
        raise UnsupportedModelError(f"a Dirichlet factor is one simplex vector; latent site {site!r} has shape "
                                    f"{shape}")
    return cls(site, shape)


def _base_constraint(c):
    while isinstance(c, constraints.independent):  # an element-wise factor over an expanded site
        c = c.base_constraint
    return c


def _same_support(a, b) -> bool:
    a, b = _base_constraint(a), _base_constraint(b)
    return type(a) is type(b) and str(a) == str(b)


def _base_transform(transform):
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return transform


def unwrap_distribution(fn) -> tuple[Any, Any]:
    """``(base distribution, transforms)`` under ``Independent`` and ``TransformedDistribution`` layers."""
    transforms: list[Any] = []
    while True:
        if isinstance(fn, dist.TransformedDistribution):
            transforms = list(fn.transforms) + transforms
            fn = fn.base_dist
        elif isinstance(fn, dist.Independent):
            fn = fn.base_dist
        else:
            return fn, transforms


_CONSTRAINED = ((dist.Beta, BetaFactor), (dist.Gamma, GammaFactor), (dist.Dirichlet, DirichletFactor),
                (dist.BernoulliProbs, BernoulliFactor))
_BUILT_IN = frozenset(EF_FAMILIES)
_REGISTERED: dict[type, Any] = {}  # distribution class -> factor class of register_factor, matched before unwrapping
_BUILT_IN_DISTRIBUTIONS = frozenset(d for d, _ in _CONSTRAINED) | {dist.CategoricalProbs, dist.Normal,
                                                                    dist.MultivariateNormal}


def register_factor(factor_class: type) -> type:
    """Make a factor the package does not ship available by its ``family_name``: to ``pc.fit``'s
    ``family={site: name}``, to :func:`numpyro_pc.dual_form` of guides whose site is its
    ``dist_class`` (arguments named by ``dist_args``), and to :func:`numpyro_pc.load` of files
    that name it (register before loading). A new family is one
    :class:`~numpyro_pc.families.expfam.Factor` subclass on the site's constrained values —
    ``stats``, ``log_normalizer``, ``in_domain``, ``to_args``, ``from_args``, ``sample`` and,
    for a Gauss rule, ``has_rule``/``rule`` — plus this call; every operation of the
    exponential-family posterior then applies (``tests/families/test_product.py`` registers an
    inverse-Gamma).

    Registering a class of the same module and name again (a re-run notebook cell, a reloaded
    module) replaces the earlier one.

    :return: ``factor_class`` (so that it can decorate the class).
    :raises InvalidOptionError: a class that is not a constrained-space ``Factor`` with a
        ``family_name``, ``support``, ``dist_class`` and ``dist_args``; a name or a
        distribution class that a built-in factor or another registered class already has.
    """
    if not (isinstance(factor_class, type) and issubclass(factor_class, Factor)):
        raise InvalidOptionError(f"register_factor expects a subclass of numpyro_pc.families.expfam.Factor, found "
                                 f"{factor_class!r}")
    name = factor_class.family_name
    missing = [attr for attr in ("support", "dist_class") if getattr(factor_class, attr, None) is None]
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()) or missing or \
            not factor_class.dist_args or factor_class.space != "constrained":
        raise InvalidOptionError(
            f"{factor_class.__name__}: a registered factor needs a lower-case identifier family_name (found {name!r}), "
            f"a support and a dist_class (missing {missing}), the dist_args of its distribution (found "
            f"{factor_class.dist_args!r}) and space 'constrained' (found {factor_class.space!r})")
    def same(other) -> bool:
        return (other.__module__, other.__qualname__) == (factor_class.__module__, factor_class.__qualname__)

    if name in _BUILT_IN or (name in EF_FAMILIES and not same(EF_FAMILIES[name])):
        raise InvalidOptionError(f"the family name {name!r} is taken by {EF_FAMILIES[name].__name__}")
    owner = _REGISTERED.get(factor_class.dist_class)
    if factor_class.dist_class in _BUILT_IN_DISTRIBUTIONS or (owner is not None and not same(owner)):
        taken_by = owner.__name__ if owner is not None else "a built-in factor"
        raise InvalidOptionError(f"guide sites of {factor_class.dist_class.__name__} are read by {taken_by}; "
                                 f"{factor_class.__name__} needs a distribution class of its own")
    stale = [d for d, c in _REGISTERED.items() if c.family_name == name]
    for d in stale:
        del _REGISTERED[d]
    EF_FAMILIES[name] = factor_class
    _REGISTERED[factor_class.dist_class] = factor_class
    return factor_class


def factor_from_distribution(site, fn, support) -> tuple[Factor, jax.Array, tuple[str, ...]]:
    """``(factor, natural, argument names)`` of a guide's sample-site distribution ``fn`` for a
    latent site of prior ``support``.

    Beta, Gamma, Dirichlet, ``Bernoulli(probs=)``, ``Categorical(probs=)`` on the site itself;
    Normal (also LogNormal and AutoNormal's transformed Normal) and
    ``MultivariateNormal(loc, scale_tril=)`` on its unconstrained value, i.e. with no
    transform on a real site or the site's own ``biject_to(support)``.

    :raises UnsupportedGuideError: for any other distribution.
    """
    inner = fn
    while isinstance(inner, dist.Independent):
        inner = inner.base_dist
    cls = _REGISTERED.get(type(inner))  # a registered class may itself be a transformed distribution
    if cls is not None:
        factor = cls(site, tuple(inner.batch_shape) + tuple(inner.event_shape))
        return factor, factor.from_args(*(getattr(inner, n) for n in cls.dist_args)), cls.dist_args
    base, transforms = unwrap_distribution(fn)
    shape = tuple(base.batch_shape) + tuple(base.event_shape)
    for dist_cls, cls in _CONSTRAINED:
        if type(base) is dist_cls and not transforms:
            if cls is DirichletFactor and base.batch_shape:
                raise UnsupportedGuideError(f"guide site {site!r}: a batched Dirichlet (batch shape "
                                            f"{tuple(base.batch_shape)}) is not supported; one simplex vector per site")
            factor = cls(site, shape)
            return factor, factor.from_args(*(getattr(base, n) for n in cls.dist_args)), cls.dist_args
    if type(base) is dist.CategoricalProbs and not transforms and not base.batch_shape:
        factor = CategoricalFactor(site, (), int(base.probs.shape[-1]))
        return factor, factor.from_args(base.probs), ("probs",)
    if type(base) in (dist.Normal, dist.MultivariateNormal):
        transform = biject_to(support) if support is not None else IdentityTransform()
        own = transforms[0] if len(transforms) == 1 else IdentityTransform() if not transforms else None
        real = isinstance(_base_transform(transform), IdentityTransform)
        if own is None or not (own == transform or (real and not transforms)):
            raise UnsupportedGuideError(
                f"guide site {site!r} is a {type(base).__name__} under transforms {transforms} but the latent site's "
                f"support {support} needs {type(transform).__name__}; a Gaussian factor lives on the site's "
                "unconstrained value (a LogNormal on a positive site, AutoNormal's sites)")
        cls = NormalFactor if type(base) is dist.Normal else FullGaussianFactor
        factor = cls(site, shape, transform)
        return factor, factor.from_args(*(getattr(base, n) for n in cls.dist_args)), cls.dist_args
    raise UnsupportedGuideError(
        f"guide site {site!r} samples from {type(fn).__name__}; a guide read as an exponential-family product may "
        "use Beta, Gamma, Dirichlet, Normal/LogNormal, MultivariateNormal(loc, scale_tril=), Bernoulli(probs=) or "
        "Categorical(probs=) sites")


@dataclass(frozen=True)
class ProductFamily(Family):
    r"""Mean-field product :math:`q(x) = \prod_k q_k(x_k)` over latent sites (trace order): a
    :class:`~numpyro_pc.protocols.family.Family` whose member ``q`` is its natural-parameter vector
    :math:`\lambda` (the factors' parameters concatenated).

    Values passed to and returned by its methods are in each factor's own coordinates
    (constrained values, unconstrained values for Gaussian factors, integers for discrete
    ones); :meth:`to_constrained` maps them to the model's site values.

    Its capabilities (:mod:`numpyro_pc.protocols.capabilities`): the natural parameters are the prior
    site plus the example sites (:class:`~numpyro_pc.protocols.capabilities.SiteSum`), so dividing sites
    out gives cavities (:class:`~numpyro_pc.protocols.capabilities.SiteDivision`; a cavity outside the
    factors' domain is refused where it is formed); the sites are natural-parameter sites
    solved by the natural-gradient fixed point, not Gaussian sites with a stored curvature.
    """

    factors: tuple

    capabilities = (SiteSum(), SiteDivision())
    lacks = MappingProxyType({
        FixedPrecision: "every factor's natural parameters are learned",
        SiteCurvature: "the sites are natural-parameter sites of the factors, not Gaussian sites with a stored "
                       "curvature",
        GaussianSolver: "the fixed point is solved by natural-gradient (Bayesian learning rule) steps in λ",
    })

    @property
    def name(self) -> str:
        """``"product(beta, gamma, ...)"``: the factors' families in trace order."""
        return "product(" + ", ".join(type(f).family_name or type(f).__name__ for f in self.factors) + ")"

    @cached_property
    def offsets(self) -> tuple[Any, ...]:
        out, pos = [], 0
        for f in self.factors:
            out.append(pos)
            pos += f.size
        return tuple(out)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.factors)

    @property
    def names(self) -> tuple[Any, ...]:
        return tuple(f.site for f in self.factors)

    def factor(self, site) -> Factor:
        """The factor of latent ``site``."""
        return self.factors[self.names.index(site)]

    def split(self, lam) -> list[Any]:
        """The factors' natural parameters."""
        return [lam[..., o:o + f.size] for f, o in zip(self.factors, self.offsets)]

    def stats(self, values) -> jax.Array:
        """``T`` of a dict of site values with a leading batch axis → ``(S, P)``."""
        return jnp.concatenate([f.stats(values[f.site]) for f in self.factors], -1)

    def log_normalizer(self, lam) -> jax.Array:
        return sum(f.log_normalizer(p) for f, p in zip(self.factors, self.split(lam)))

    def natural(self, q) -> jax.Array:
        r"""The natural parameters :math:`\lambda` of ``q``: ``q`` itself (a product's member is its
        natural-parameter vector)."""
        return q

    def expectation(self, lam) -> jax.Array:
        r"""Mean parameters :math:`\mu = \nabla A(\lambda) = E_q[T(x)]`."""
        return jax.grad(self.log_normalizer)(lam)

    def fisher(self, lam) -> jax.Array:
        r"""Fisher information :math:`F(\lambda) = \nabla^2 A(\lambda)` (block diagonal)."""
        return jax.hessian(self.log_normalizer)(lam)

    def in_domain(self, lam) -> jax.Array:
        ok = jnp.asarray(True)
        for f, p in zip(self.factors, self.split(lam)):
            ok = ok & f.in_domain(p)
        return ok

    def entropy(self, lam) -> jax.Array:
        r""":math:`H[q] = A(\lambda) - \langle \lambda, \mu \rangle` (Lebesgue or counting base measure;
        a Gaussian factor's entropy is that of its unconstrained coordinates)."""
        return self.log_normalizer(lam) - jnp.dot(lam, self.expectation(lam))

    def kl(self, lam1, lam2) -> jax.Array:
        r""":math:`KL(q_1 \| q_2) = A(\lambda_2) - A(\lambda_1) - \langle \lambda_2 - \lambda_1, \mu_1 \rangle`."""
        return self.log_normalizer(lam2) - self.log_normalizer(lam1) - jnp.dot(lam2 - lam1, self.expectation(lam1))

    def log_prob(self, lam, values) -> jax.Array:
        """:math:`\\log q(x)` of a dict of site values (leading batch axis, factor coordinates)."""
        return self.stats(values) @ lam - self.log_normalizer(lam)

    def from_expectation(self, mu, lam0, num_iters=60) -> jax.Array:
        r"""Natural parameters with :math:`\nabla A(\lambda) = \mu`: damped Newton on the convex
        :math:`A(\lambda) - \langle\lambda,\mu\rangle` from ``lam0``, each step halved until the
        iterate stays in the domain and the objective does not increase."""
        objective = lambda lam: self.log_normalizer(lam) - jnp.dot(lam, mu)  # noqa: E731
        steps = 0.5 ** jnp.arange(40, dtype=lam0.dtype)

        def body(_, lam) -> jax.Array:
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

    def sample(self, q, key, num_samples) -> dict[Any, Any]:
        """A dict of ``num_samples`` draws per site of the member with natural parameters ``q``, in the
        factors' coordinates (the argument order of every :class:`~numpyro_pc.protocols.family.Family`)."""
        keys = jax.random.split(key, len(self.factors))
        return {f.site: f.sample(k, p, num_samples) for f, k, p in zip(self.factors, keys, self.split(q))}

    def to_constrained(self, values) -> dict[Any, Any]:
        """The model's site values of factor-coordinate ``values``."""
        return {f.site: f.to_constrained(values[f.site]) for f in self.factors}

    def mean(self, lam) -> dict[Any, Any]:
        """:math:`E_q[x]` of each site's constrained value."""
        return {f.site: f.mean(p) for f, p in zip(self.factors, self.split(lam))}

    def default_natural(self, dtype) -> jax.Array:
        return jnp.concatenate([jnp.reshape(f.default_natural(dtype), (-1,)) for f in self.factors])

    def has_rule(self) -> bool:
        """Whether every factor has a deterministic rule (then the design is one tensor grid)."""
        return all(f.has_rule for f in self.factors)

    def grid_size(self, num_nodes, use_rules=True) -> int:
        """Points of the tensor grid of the factors that have a rule (1 when none does)."""
        size = 1
        for f in self.factors:
            if use_rules and f.has_rule:
                size *= f.rule_size(num_nodes)
        return size

    def drawn_size(self, use_rules=True) -> int:
        """Natural parameters of the factors that are integrated by draws (the others have a rule)."""
        return sum(f.size for f in self.factors if not (use_rules and f.has_rule))

    def admits_cubature(self) -> bool:
        """Whether every factor without a Gauss rule is a Gaussian block (then the symmetric
        cubature of :func:`numpyro_pc.families.point_sets.symmetric_cubature` can stand for them)."""
        return all(f.has_rule or f.space == "unconstrained" for f in self.factors)

    def cubature_size(self) -> int:
        """Points of the symmetric cubature over the Gaussian blocks without a rule: ``2 D + 1``."""
        return 2 * sum(f.dim for f in self.factors if not f.has_rule) + 1

    def cubature_blocks(self) -> int:
        """How many Gaussian blocks share the cubature (those without a rule)."""
        return sum(1 for f in self.factors if not f.has_rule)

    def design(self, lam, num_nodes, num_samples, seed, use_rules=True, cubature=False) -> tuple[Any, Any]:
        """Points standing for ``q``: the tensor grid of the factors' rules (``use_rules``) times
        ``num_samples`` fixed draws of the other factors, or (``cubature``, where
        :meth:`admits_cubature`) times the ``2D + 1`` points of the symmetric cubature over the
        Gaussian blocks jointly, drawn with ``seed``; ``(values dict (S, ...), weights (S,))``."""
        parts = self.split(lam)
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.factors))
        ruled = [k for k, f in enumerate(self.factors) if use_rules and f.has_rule]
        drawn = [k for k in range(len(self.factors)) if k not in ruled]
        rules = {k: self.factors[k].rule(parts[k], num_nodes) for k in ruled}
        sizes = [rules[k][1].shape[0] for k in ruled]
        idx = [g.reshape(-1) for g in jnp.meshgrid(*[jnp.arange(n) for n in sizes], indexing="ij")] if ruled else []
        grid_w = jnp.prod(jnp.stack([rules[k][1][i] for k, i in zip(ruled, idx)]), 0) if ruled else \
            jnp.ones((1,), lam.dtype)
        if cubature and drawn:
            points, point_w = symmetric_cubature(keys[0], sum(self.factors[k].dim for k in drawn), lam.dtype)
            cuts = np.cumsum([0] + [self.factors[k].dim for k in drawn])
            drawn_values = {k: self.factors[k].from_whitened(parts[k], points[:, a:b])
                            for k, a, b in zip(drawn, cuts[:-1], cuts[1:])}
        else:
            drawn_values = {k: self.factors[k].design_draws(keys[k], parts[k], num_samples) for k in drawn}
            point_w = None
        reps = next(iter(drawn_values.values())).shape[0] if drawn else 1
        values = {}
        for k, i in zip(ruled, idx):
            values[self.factors[k].site] = jnp.repeat(rules[k][0][i], reps, axis=0)
        for k, draws in drawn_values.items():
            values[self.factors[k].site] = jnp.tile(draws, (grid_w.shape[0],) + (1,) * (draws.ndim - 1))
        if point_w is None:
            weights = jnp.repeat(grid_w, reps) / reps
        else:
            weights = jnp.repeat(grid_w, reps) * jnp.tile(point_w, grid_w.shape[0])
        return values, weights

    def describe(self, lam) -> dict[Any, tuple[Any, dict[Any, Any]]]:
        """Per site: the family and its distribution arguments (for messages and records)."""
        return {f.site: (f.family_name, {n: v for n, v in zip(f.dist_args, f.to_args(p))})
                for f, p in zip(self.factors, self.split(lam))}


def site_names(spec) -> tuple[str, ...]:
    """The posterior's latent sites: the continuous ones in trace order, then the discrete ones."""
    return tuple(spec.latent.names) + tuple(spec.latent.discrete_names)


def site_supports(spec, data) -> dict:
    """Each latent site's support, read from one trace of the model at ``z = 0``."""
    z0 = jnp.zeros(spec.latent.dim, jnp.result_type(float))
    trace = trace_at(spec, z0, tuple(x[:1] for x in data.per_example), data.shared)
    return {n: trace[n]["fn"].support for n in site_names(spec)}


def site_shape(spec, name) -> tuple:
    """The shape of latent site ``name`` (continuous or discrete)."""
    latent = spec.latent
    if name in latent.names:
        return latent.shapes[latent.names.index(name)]
    return latent.discrete_shapes[latent.discrete_names.index(name)]


def family_for_model(spec, data, family) -> ProductFamily:
    """The :class:`~numpyro_pc.families.product.ProductFamily` of a ``{site: family name}`` dict
    (names in :data:`~numpyro_pc.families.product.EF_FAMILIES`), in the posterior's site order.

    :raises UnsupportedModelError: a latent site without a family, or unknown sites.
    """
    names = site_names(spec)
    unknown = sorted(set(family) - set(names))
    missing = [n for n in names if n not in family]
    if unknown or missing:
        raise UnsupportedModelError(f"family= must name every latent site {list(names)} (missing {missing}, "
                                    f"unknown {unknown})")
    supports = site_supports(spec, data)
    return ProductFamily(tuple(make_factor(family[n], n, site_shape(spec, n), supports[n]) for n in names))
