r"""Per-example losses of a NumPyro model over its data plate, as functions of ``z``.

For a model with global latent variables and a plate over the data, this module gives
the loss of each element ``i`` of the data plate and the prior term, both as functions
of the flat unconstrained vector ``z`` (docs/notation.md, "Symbols"):

.. math::

    \ell_0(z) = -\log p_0(T(z)) - \log|\det J_T(z)|, \qquad
    \ell_i(z) = -\log p(y_i \mid T(z)),

so that ``ℓ_0(z) + Σ_i ℓ_i(z)`` equals ``numpyro.infer.util.potential_energy``.
Several observed sites inside the plate add up per example; ``mask``/``obs_mask`` and
``scale`` handlers are respected. Observed sites and factors outside the data plate
belong to ``ℓ_0``. A model vectorised over the rows without a plate has an implicit data
plate (:data:`IMPLICIT_PLATE`) holding every observed site; it is evaluated the same way.

The binding is split in two: a hashable, static :class:`ModelSpec` (the model, its
latent space, which arguments are per-example) and a :class:`ModelData` pytree of
arrays, so jitted functions keyed on the spec do not retrace for new data of the same
size. Example ``i`` is evaluated by running the model on the slice ``[i:i+1]`` of every
per-example argument; evaluation over all examples is a ``vmap`` of that. Turning a model
and its arguments into ``(spec, data)`` — and checking the binding — is
:func:`numpyro_pc.model.likelihood.bind_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost

from numpyro_pc.errors import NonFiniteResultError, UnsupportedModelError

from .latent import LatentSpace
from .prediction_matching import prediction_kl, split_matching
from .prediction_matching import rebuild as rebuild_site
from .locals import conditional_draw, laplace_marginal, stack_rows
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["LOG_DET_PREFIX", "IMPLICIT_PLATE", "ModelSpec", "ModelData", "trace_at", "prior_loss", "example_loss", "example_params",
           "example_site_log_likelihoods", "example_joint_loss", "local_draws", "losses", "constrain", "is_array",
           "output_dependence"]


LOG_DET_PREFIX = "_pc_log_det_"
IMPLICIT_PLATE = "_rows"
"""Name of the data plate of a model whose observed sites are vectorised over the rows
without a ``numpyro.plate`` (see :func:`numpyro_pc.model.likelihood.bind_model`)."""


class ModelData(NamedTuple):
    """Array arguments of the model: per-example (leading axis = data plate) and shared."""

    per_example: tuple
    shared: tuple


@dataclass(frozen=True)
class ModelSpec:
    """Static description of a model bound to its arguments' structure.

    :ivar model: the NumPyro model callable.
    :ivar latent: the :class:`~numpyro_pc.model.latent.LatentSpace`.
    :ivar plate: name of the data plate (:data:`IMPLICIT_PLATE` when the observed sites are
        vectorised over the rows without a plate).
    :ivar num_examples: size ``N`` of the data plate for the bound data.
    :ivar observed: names of the observed sites inside the data plate (every observed site
        for the implicit plate); their log-densities make up ``ℓ_i``.
    :ivar param_leaves: per observed site, which float leaves of its distribution depend
        on ``z`` (the distribution parameters ``θ_i`` used for Gauss–Newton and
        Gauss–Hermite).
    :ivar num_params: ``k``, the number of such parameters per example.
    :ivar affine: whether ``θ_i(z)`` is affine in ``z`` (GLM-type model), so that the
        Hessian equals the Gauss–Newton matrix and sites factorise exactly.
    :ivar support_sites: the observed sites whose values are checked against their
        distribution's support on every batch (:mod:`numpyro_pc.model.data_support`).
    :ivar local: the latent sites inside the data plate, as one example sees them (plate
        axis of size one), or ``None``; they are integrated per example
        (:mod:`numpyro_pc.model.locals`) and ``latent`` holds the global sites only.
    :ivar local_axes: per local site, the axis of its value that the data plate indexes.
    :ivar matching: the rows carry two more leaves, and a row marked ``matched`` has the K-prior's
        label-free loss ``κ_i`` instead of ``ℓ_i`` (:mod:`numpyro_pc.model.prediction_matching`).
    """

    model: object
    latent: LatentSpace
    plate: str
    num_examples: int
    treedef: object
    kinds: tuple
    statics: tuple
    observed: tuple
    param_leaves: tuple = ()
    num_params: int = 0
    affine: bool = False
    support_sites: tuple = ()
    local: LatentSpace | None = None
    local_axes: tuple = ()
    arg_names: tuple = field(default=(), compare=False, hash=False)
    matching: bool = False

    def build_args(self, per_example, shared) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from the array leaves."""
        ex, sh, st = iter(per_example), iter(shared), iter(self.statics)
        leaves = [next(ex) if k == "example" else next(sh) if k == "shared" else next(st) for k in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves)


def output_dependence(closed_jaxpr, inputs=None) -> list:
    """Which outputs of a jaxpr depend on its inputs, or on the inputs at positions ``inputs``
    (conservative through sub-calls)."""
    jaxpr = closed_jaxpr.jaxpr
    dependent = set(map(id, jaxpr.invars if inputs is None else [jaxpr.invars[i] for i in inputs]))
    for eqn in jaxpr.eqns:
        if any(id(v) in dependent for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
            dependent.update(id(v) for v in eqn.outvars)
    return [not isinstance(v, jax.extend.core.Literal) and id(v) in dependent for v in jaxpr.outvars]


def is_array(x) -> bool:
    """Whether a model argument is an array (data) rather than a fixed, non-array value."""
    return isinstance(x, (jax.Array, np.ndarray)) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _substitute_unconstrained(values, site):
    """``substitute_fn`` placing unconstrained values and recording their log-det-Jacobian."""
    name = site["name"]
    if site["type"] != "sample" or site["is_observed"] or name not in values:
        return None
    u = values[name]
    support = site["fn"].support
    if support is constraints.real or (
        isinstance(support, constraints.independent) and support.base_constraint is constraints.real
    ):
        return u
    transform = biject_to(support)
    value = transform(u)
    log_det = transform.log_abs_det_jacobian(u, value)
    log_det = sum_rightmost(log_det, jnp.ndim(log_det) - jnp.ndim(value) + len(site["fn"].event_shape))
    if site["scale"] is not None:
        log_det = site["scale"] * log_det
    numpyro.factor(LOG_DET_PREFIX + name, log_det)
    return value


def trace_at(spec, z, per_example, shared, discrete=None, local=None) -> dict[str, Any]:
    """The model's trace at flat unconstrained ``z`` (and values of its discrete latents).

    ``local`` holds the unconstrained values of the local latents for the rows given, flat
    ``(m,)`` for one example or a dict of whole-plate values; without it they are fixed at
    ``0`` in unconstrained space (a trace that reads only globals and observations, with no
    sampler called and nothing random)."""
    args, kwargs = spec.build_args(per_example, shared)
    values = spec.latent.unravel(z)
    if spec.local is not None:
        if local is None:
            rows = int(jnp.shape(per_example[0])[0]) if per_example else 1
            local = {name: jnp.zeros(shape[:axis] + (rows,) + shape[axis + 1:], jnp.result_type(z))
                     for name, shape, axis in zip(spec.local.names, spec.local.unconstrained_shapes, spec.local_axes)}
        values = {**values, **(local if isinstance(local, dict) else spec.local.unravel(local))}
    discrete = discrete or {}

    def sub(site):
        if site["type"] == "sample" and not site["is_observed"] and site["name"] in discrete:
            return discrete[site["name"]]
        return _substitute_unconstrained(values, site)

    model = handlers.substitute(handlers.seed(spec.model, 0), substitute_fn=sub)
    with handlers.block():  # inner evaluations never leak sites to outer handlers
        return handlers.trace(model).get_trace(*args, **kwargs)


def _site_log_prob(site) -> jax.Array:
    lp = site["fn"].log_prob(site["value"])
    if site.get("mask") is not None:
        lp = jnp.where(site["mask"], lp, 0.0)
    if site.get("scale") is not None:
        lp = site["scale"] * lp
    return jnp.sum(lp)


def in_plate(site, plate) -> bool:
    """Whether a trace site sits inside the plate named ``plate``."""
    return any(f.name == plate for f in site["cond_indep_stack"])


def prior_loss(spec, z, data, discrete=None) -> jax.Array:
    """``ℓ_0(z)``: negative log prior of the latents in unconstrained space (with the
    Jacobian of the constraining transforms) plus observed sites/factors outside the
    data plate; ``discrete`` holds the values of discrete latents, if the binding has any."""
    first = tuple(x[:1] for x in data.per_example)
    trace = trace_at(spec, z, first, data.shared, discrete)
    total = 0.0
    for site in trace.values():
        if site["type"] != "sample":
            continue
        if site["is_observed"] and (site["name"] in spec.observed or in_plate(site, spec.plate)):
            continue
        if spec.local is not None and site["name"] in spec.local.names:  # integrated in ℓ_i
            continue
        total = total + _site_log_prob(site)
    return -total


def example_args(example) -> tuple[Any, ...]:
    """One example's per-example arrays with a leading axis of size 1 (the model's view of it)."""
    return tuple(x[None] for x in example)


def example_loss(spec, z, example, shared, discrete=None) -> jax.Array:
    """``ℓ_i(z)`` for one example (per-example leaves without their leading axis); with local
    latents, the unit's negative log marginal likelihood (:mod:`numpyro_pc.model.locals`)."""
    if spec.matching:
        if spec.local is not None or discrete:
            raise UnsupportedModelError("prediction matching compares an example's observed distributions given the "
                                        "global latents alone; this binding integrates local or discrete latents")
        theta, loss_fn = example_params(spec, z, example, shared)
        return loss_fn(theta)
    if spec.local is not None:
        return laplace_marginal(lambda zz, u: example_joint_loss(spec, zz, u, example, shared), z, spec.local.dim)
    if False:
        return loss_fn(theta)
    trace = trace_at(spec, z, example_args(example), shared, discrete)
    return -sum(_site_log_prob(trace[name]) for name in spec.observed)


def example_joint_loss(spec, z, u, example, shared) -> jax.Array:
    """``f_i(z, u) = −log p(y_i | z, u) − log p(u | z)`` of one example with local latents
    at unconstrained ``u`` (log-Jacobian of their constraining transforms included)."""
    trace = trace_at(spec, z, example_args(example), shared, local=u)
    total = sum(_site_log_prob(trace[name]) for name in spec.observed)
    for name in spec.local.names:
        total = total + _site_log_prob(trace[name])
        if LOG_DET_PREFIX + name in trace:
            total = total + _site_log_prob(trace[LOG_DET_PREFIX + name])
    return -total


def example_site_log_likelihoods(spec, z, example, shared, discrete=None) -> tuple[Any, ...]:
    """Log-likelihood of one example per observed site (a tuple in ``spec.observed`` order).

    With local latents the sites of a unit share its integrated latents, so only their
    joint marginal exists: it is returned for a single observed site, and refused for several.
    """
    if spec.local is not None:
        if len(spec.observed) > 1:
            raise UnsupportedModelError(
                f"the observed sites {list(spec.observed)} of a unit share its local latents "
                f"{list(spec.local.names)}, which are integrated out: only their joint marginal "
                "log-likelihood -ℓ_i exists, not one per site (use the per-example losses).")
        return (-example_loss(spec, z, example, shared),)
    trace = trace_at(spec, z, example_args(example), shared, discrete)
    return tuple(_site_log_prob(trace[name]) for name in spec.observed)


def site_log_likelihoods(spec, data, z) -> dict[str, jax.Array]:
    """Per observed site, each example's log-likelihood at flat unconstrained latents ``z``
    (trailing axis ``d``, any leading axes): ``{site: (..., N)}``."""
    z = jnp.asarray(z)
    per_point = lambda zz: jax.vmap(lambda ex: example_site_log_likelihoods(spec, zz, ex, data.shared))(  # noqa: E731
        data.per_example)
    values = jax.vmap(per_point)(jnp.reshape(z, (-1, spec.latent.dim)))
    return {name: jnp.reshape(v.T if v.ndim == 1 else v, z.shape[:-1] + (-1,)) for name, v in zip(spec.observed, values)}


def example_params(spec, z, example, shared) -> tuple[jax.Array, Any]:
    """Split ``ℓ_i`` into distribution parameters and a loss of those parameters.

    :return: ``(theta, loss_fn)`` with ``theta`` the ``k`` z-dependent float parameters
        of the example's observed distributions (flattened) and ``loss_fn(theta)`` the
        negative log-likelihood, so that ``ℓ_i(z) = loss_fn(theta(z))``. With local latents
        the marginal ``ℓ_i`` has no such parameters: ``theta = z`` (``k = d``, affine).
    """
    if spec.local is not None:
        return z, lambda theta: example_loss(spec, theta, example, shared)
    trace = trace_at(spec, z, example_args(example), shared)
    pieces, rebuild = [], []
    for name, mask in zip(spec.observed, spec.param_leaves):
        site = trace[name]
        leaves, treedef = jax.tree.flatten(site["fn"])
        for leaf, dep in zip(leaves, mask):
            if dep:
                pieces.append(jnp.reshape(leaf, -1))
        rebuild.append((site, leaves, treedef, mask))
    theta = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), z.dtype)

    def loss_fn(theta) -> jax.Array:
        total, pos = 0.0, 0
        for site, leaves, treedef, mask in rebuild:
            fn, pos = rebuild_site(site, leaves, treedef, mask, theta, pos)
            total = total + _site_log_prob({**site, "fn": fn})
        return -total

    if spec.matching:
        _, theta_old, matched = split_matching(spec, example)

        def matched_loss(theta) -> jax.Array:
            total, pos, pos_old = 0.0, 0, 0
            for site, leaves, treedef, mask in rebuild:
                fn, pos = rebuild_site(site, leaves, treedef, mask, theta, pos)
                old, pos_old = rebuild_site(site, leaves, treedef, mask, theta_old, pos_old)
                kl = prediction_kl(old, fn, site["name"])
                if site.get("mask") is not None:
                    kl = jnp.where(site["mask"], kl, 0.0)
                if site.get("scale") is not None:
                    kl = site["scale"] * kl
                total = total + jnp.sum(kl)
            return total

        return theta, lambda t: jnp.where(matched > 0, matched_loss(t), loss_fn(t))

    return theta, loss_fn


def local_draws(spec, data, z, key) -> dict[str, jax.Array]:
    """Constrained draws of the local latents of every row of ``data``, one per global draw
    ``z`` ``(S, d)``: ``u_i ~ N(u*_i(z), H_i^{-1})``, the local factor of
    :mod:`numpyro_pc.model.locals`. Returns ``{site: (S, *shape)}`` with each site laid out
    over the whole data plate, as NumPyro's ``Predictive`` gives it.

    :raises NonFiniteResultError: a unit whose local latents have no conditional mode at some draw.
    """
    draws = _local_draws(spec, data, z, key)
    bad = {name: int(np.sum(~np.all(np.isfinite(np.asarray(v)).reshape(v.shape[0], -1), axis=1)))
           for name, v in draws.items()}
    if any(bad.values()):
        raise NonFiniteResultError(
            f"the local latents have no conditional mode for some units at {max(bad.values())} of {z.shape[0]} global "
            "draws (Newton's search found no point with a positive-definite Hessian), so those units cannot be drawn; "
            "the global draws reach a region where a unit's local posterior is improper.")
    return draws


@partial(jax.jit, static_argnums=0)
def _local_draws(spec, data, z, key) -> dict[str, jax.Array]:
    keys = jax.random.split(key, z.shape[0] * data.per_example[0].shape[0])
    keys = jnp.reshape(keys, (z.shape[0], data.per_example[0].shape[0]) + keys.shape[1:])

    def per_draw(zz, row_keys) -> dict[str, jax.Array]:
        def row(example, k) -> dict[str, jax.Array]:
            u = conditional_draw(lambda uu: example_joint_loss(spec, zz, uu, example, data.shared),
                                 spec.local.dim, k, zz.dtype)
            trace = trace_at(spec, zz, example_args(example), data.shared, local=u)
            return {name: trace[name]["value"] for name in spec.local.names}

        rows = jax.vmap(row)(data.per_example, row_keys)
        return stack_rows(spec.local, spec.local_axes, rows, spec.local.shapes)

    return jax.lax.map(lambda args: per_draw(*args), (z, keys))


def losses(spec, z, data) -> jax.Array:
    """Vector ``(ℓ_1(z), …, ℓ_N(z))`` over the data plate (vmapped over examples)."""
    return jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared))(data.per_example)


def constrain(spec, z, data) -> dict[Any, Any]:
    """Constrained values of the latent sites at ``z`` (a dict in trace order).

    The global sites' values do not depend on the examples (local latents are not among
    them: :func:`local_draws` draws those), so a posterior that keeps no data rows traces the
    model on one zero-valued row.
    """
    first = tuple(x[:1] if x.shape[0] else jnp.zeros((1,) + tuple(x.shape[1:]), x.dtype) for x in data.per_example)
    trace = trace_at(spec, z, first, data.shared)
    return {name: trace[name]["value"] for name in spec.latent.names}
