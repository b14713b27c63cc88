r"""NumPyro effect handlers that turn a dual-form posterior into a corrected model.

:func:`update` and :func:`forget` return plain NumPyro models, so *any* inference
algorithm (NUTS, SVI with any guide, ...) can be run on the corrected objectives of
paper §3.1 and docs/adapting.md, "Any inference algorithm on the corrected objective":

.. math::

    \text{update:}\quad p(z \mid y_{new}) \propto q_t(z)\, p(y_{new}\mid z)
        \prod_{i \in C} e^{-(\ell_i(z) - \hat\ell_{i|t}(z))}, \qquad
    \text{forget:}\quad q_t(z) \prod_{j\in J} e^{\hat\ell_{j|t}(z)} \prod_{i \in C\setminus J} e^{-(\ell_i(z) - \hat\ell_{i|t}(z))} .

With ``C`` every retained example and the prior, the corrected model's posterior is the
exact posterior given all data. The building block is :class:`posterior_prior`, a
``Messenger`` that replaces each latent site's prior with an improper flat density on the
same support and adds one factor ``log q_t(z) − log|det J_T(z)|``, so that inference in
unconstrained space sees exactly ``q_t(z)``. For an exponential-family
:class:`~numpyro_pc.dual.expfam.EFPosterior` (a mean-field product over the constrained
values) the posterior as prior is simply each latent site's distribution replaced by its
factor. Inner evaluations run under ``block`` and never leak sites to outer handlers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions.transforms import biject_to
from numpyro.primitives import Messenger

from numpyro_pc.errors import ConvergenceError, InvalidOptionError, ModelMismatchError, PosteriorCorrectionError
from numpyro_pc.model.likelihood import bind_model, example_loss, prior_loss
from numpyro_pc.model.rows import as_ids, memory_ids, positions, take_data
from numpyro_pc.protocols.capabilities import SiteDivision, require
from numpyro_pc.protocols.posterior import require_posterior
from numpyro_pc.solvers.fixed_point import default_tol

__all__ = ["posterior_prior", "correction_factor", "update", "forget", "check_same_model", "require_fixed_point"]


class posterior_prior(Messenger):
    """Replace the prior of the latent sites by a :class:`~numpyro_pc.DualPosterior` or an
    :class:`~numpyro_pc.dual.expfam.EFPosterior`.

    Gaussian posterior: each latent site's distribution becomes ``ImproperUniform`` on its
    support; after the model has run, a factor site ``"_pc_posterior_prior"`` adds
    ``log q_t(z)`` minus the log-Jacobian that inference adds back for the constrained sites.

    exponential-family posterior: each latent site's distribution becomes its factor
    (``posterior.distributions()``, with the site's event dimensions); the product of the
    factors is the posterior, so no factor site is added.

    :param fn: a NumPyro model.
    :param posterior: the posterior acting as prior.
    :param extra_log_density: optional ``z -> scalar`` added to the same factor (used for
        correction terms), a function of the family's coordinates (:func:`correction_factor`).
    :raises ModelMismatchError: (when the model runs) a latent site the posterior does not
        have, of another shape, or a posterior site the model does not sample.
    """

    def __init__(self, fn=None, posterior=None, extra_log_density=None):
        if posterior is None:
            raise InvalidOptionError("posterior_prior needs a posterior")
        require_posterior(posterior, "posterior_prior")
        latent = posterior.spec.latent
        self._factors = posterior.latent_factors()
        self._shapes = dict(zip(latent.names + latent.discrete_names, latent.shapes + latent.discrete_shapes))
        self._latent = posterior.spec.latent
        self._local = () if posterior.spec.local is None else posterior.spec.local.names
        self.posterior = posterior
        self.extra = extra_log_density
        self._values = {}
        super().__init__(fn)

    def process_message(self, msg) -> None:
        if msg["type"] == "sample" and not msg["is_observed"] and msg["name"] in self._shapes:
            fn = msg["fn"]
            if self._factors is None:
                msg["fn"] = dist.ImproperUniform(fn.support, fn.batch_shape, fn.event_shape)
            else:
                msg["fn"] = self._factor(msg["name"], fn)

    def _factor(self, name, fn) -> dist.Distribution:
        """The site's factor with the model distribution's batch and event shapes."""
        expected = tuple(self._shapes[name])
        found = tuple(fn.batch_shape) + tuple(fn.event_shape)
        factor = self._factors[name]
        extra = len(fn.event_shape) - len(factor.event_shape)
        if found != expected or extra < 0:
            raise ModelMismatchError(
                f"latent site {name!r} has shape {found} (event shape {tuple(fn.event_shape)}) in this model but "
                f"{expected} (event shape {tuple(factor.event_shape)}) in the posterior; was the model called with "
                "other sizes?")
        return factor.to_event(extra) if extra else factor

    def postprocess_message(self, msg) -> None:
        if msg["type"] != "sample" or msg["is_observed"] or msg["infer"].get("is_auxiliary"):
            return
        if msg["name"] in self._local:  # a unit's latent keeps its prior given the globals: p(u | z)
            return
        if msg["name"] not in self._shapes:
            raise ModelMismatchError(
                f"the model samples a latent site {msg['name']!r} that the posterior does not have (its latent sites "
                f"are {list(self._shapes)}); a posterior can only act as the prior of the model it was fitted to.")
        expected = self._shapes[msg["name"]]
        if tuple(jnp.shape(msg["value"])) != tuple(expected):
            raise ModelMismatchError(
                f"latent site {msg['name']!r} has shape {tuple(jnp.shape(msg['value']))} in this model but "
                f"{tuple(expected)} in the posterior; was the model called with other sizes?")
        self._values[msg["name"]] = (msg["value"], msg["fn"].support)

    def __call__(self, *args, **kwargs) -> Any:
        self._values = {}
        with self:
            out = self.fn(*args, **kwargs)
            missing = [n for n in self._shapes if n not in self._values]
            if missing:
                raise ModelMismatchError(f"the model did not sample the posterior's latent sites {missing}")
            if self._factors is not None:  # the factors are the posterior; correction terms in their coordinates
                if self.extra is not None:
                    point = self.posterior.point_of({n: v for n, (v, _) in self._values.items()})
                    numpyro.factor("_pc_posterior_prior", self.extra(point))
                return out
            latent = self._latent
            unconstrained, log_det = {}, 0.0
            for name in latent.names:
                value, support = self._values[name]
                transform = biject_to(support)
                u = transform.inv(value)
                unconstrained[name] = u
                log_det = log_det + jnp.sum(transform.log_abs_det_jacobian(u, value))
            z = latent.ravel(unconstrained)
            log_density = self.posterior.log_prob(z) - log_det
            if self.extra is not None:
                log_density = log_density + self.extra(z)
            numpyro.factor("_pc_posterior_prior", log_density)
        return out


class _drop_observations(Messenger):
    """Mask out observed sites only (latent sites and their Jacobian factors stay)."""

    def process_message(self, msg) -> None:
        if msg["type"] == "sample" and msg["is_observed"] and not msg["name"].startswith("_"):
            msg["fn"] = msg["fn"].mask(False)


def correction_factor(posterior, memory: str | Iterable[int] = "all", correct_prior: bool = True,
                      removed: Iterable[int] = ()) -> Callable:
    r"""``point ↦`` the log-density of the correction terms (paper §3.1).

    ``−Σ_{i∈C}(ℓ_i − ℓ̂_i) − (ℓ_0 − ℓ̂_0)`` over the memory ``C`` (the prior term when
    ``correct_prior``), plus ``+Σ_{j∈removed} ℓ̂_j`` for deleted examples, each site in
    natural-parameter form :math:`\hat\ell_i = -\langle\hat\lambda_i, T\rangle`
    (:meth:`~numpyro_pc.protocols.sites.SiteTable.values`), at a point of the family's coordinates:
    the flat unconstrained ``z`` of a Gaussian family, ``{site: coordinate}`` of a product
    (:meth:`~numpyro_pc.protocols.posterior.Posterior.point_of`). A ratio of two densities in the
    same coordinates is a function of the latent values, whatever the coordinates.

    :param memory: ``"all"`` (every retained example), ``"none"`` or a list of ids.
    :raises UnknownExampleError: ids that the posterior does not hold.
    :raises MissingCapabilityError: a family whose sites cannot be divided out of ``q`` (isotropic,
        low-rank).
    """
    require_posterior(posterior, "correction_factor")
    require(posterior.family, SiteDivision, "the corrected model q · Π_i exp(ℓ̂_i − ℓ_i)")
    post, family, spec = posterior, posterior.family, posterior.spec
    retained, held = np.asarray(post.data_ids), np.asarray(post.sites.ids)
    removed = as_ids(removed)
    ids = memory_ids(memory, retained, removed)
    data = take_data(post.data, positions(retained, ids, "retained example"))
    sites = post.sites.take(positions(held, ids))
    gone = post.sites.take(positions(held, removed, "example with a site"))

    def log_density(point) -> jax.Array:
        z, discrete, log_det = post.model_point(point)
        total = jnp.sum(gone.values(family, point)[0])
        values, prior_value = sites.values(family, point)
        if ids.size:
            per = jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared, discrete))(data.per_example)
            total = total - (jnp.sum(per) - jnp.sum(values))
        if correct_prior:
            total = total - (prior_loss(spec, z, post.data, discrete) + log_det - prior_value)
        return total

    return log_density


def update(model: Callable, posterior, memory: str | Iterable[int] = "all", correct_prior: bool = True) -> Callable:
    """A NumPyro model whose posterior on new data is the corrected update of ``posterior``.

    Call it with the new batch like the original model; e.g.
    ``MCMC(NUTS(pc.handlers.update(model, post)), ...).run(key, X_new, y_new)``. For an
    :class:`~numpyro_pc.dual.expfam.EFPosterior` the sites are linear in the factors'
    statistics (:func:`correction_factor`).

    :param memory: past examples to correct: ``"all"`` retained (exact), ``"none"`` (VCL
        when ``correct_prior=False``) or a list of ids.
    :param bool correct_prior: replace the prior's site by the true prior term.
    """
    check_same_model(model, posterior)
    require_fixed_point(posterior, "pc.handlers.update")
    return posterior_prior(model, posterior, correction_factor(posterior, memory, correct_prior))


def require_fixed_point(posterior, what: str) -> None:
    """Refuse a posterior that is not at its fixed point for an operation built on its sites.

    The corrected models of :func:`update` and :func:`forget` are exact only when ``q`` is
    the product of the prior's site and the examples' sites (``λ = λ₀ + Σᵢ λᵢ``, the
    residual at its tolerance): from a fit that stopped early (``raise_on_failure=False``)
    the correction terms describe another distribution, and a sampler run on the corrected
    model answers another question without saying so.

    :raises ConvergenceError: the residual is above 100× the dtype's default tolerance (the
        error carries the posterior as ``err.posterior``).
    """
    residual = float(posterior.site_identity_residual)
    limit = 100 * default_tol(jnp.result_type(*jax.tree.leaves(posterior.natural)))
    if not residual <= limit:
        raise ConvergenceError(
            f"{what} needs a posterior at its fixed point (dual-form residual ≤ {limit:.0e}); this one's residual is "
            f"{residual:.2e}, so its sites do not represent it and the corrected model would be another model's "
            "posterior. Refine it first (post.refine(), or a larger max_iters), or refit.", posterior=posterior)


def check_same_model(model, posterior, num_probes=3) -> None:
    """Refuse ``model`` unless it is the posterior's model: same latent sites and shapes, same
    prior term and same per-example likelihood at probe points around the posterior mean.

    A model object other than the fitted one is bound to one retained example with the
    fitted arguments, and its prior term and per-example loss are compared with the
    posterior's to 1e-8 relative (float64) at ``num_probes`` points.

    :raises ModelMismatchError: naming what differs.
    :raises UnsupportedGuideError: an object that is not a dual-form posterior.
    """
    require_posterior(posterior, "pc.handlers.check_same_model")
    spec = posterior.spec
    if model is spec.model or posterior.num_retained == 0:
        return
    first = take_data(posterior.data, np.zeros(1, np.int64))
    other, data = bind_like(spec, model, first, allow_discrete=bool(spec.latent.discrete_names))
    ours, theirs = latent_layout(spec), latent_layout(other)
    if ours != theirs:
        raise ModelMismatchError(f"the model's latent sites {theirs} differ from the posterior's {ours} "
                                 "(names and shapes, constrained and unconstrained)")
    dtype = jnp.result_type(*jax.tree.leaves(posterior.q))
    rtol = 1e-8 if dtype == jnp.float64 else 1e-4
    check_terms_agree(spec, other, first, data, posterior.probe_points(num_probes), rtol, "a probe point")


def latent_layout(spec) -> dict:
    """``{site: (constrained shape, unconstrained shape)}`` of a binding's latent sites, discrete ones included."""
    latent = spec.latent
    return dict(zip(latent.names + latent.discrete_names,
                    zip(latent.shapes + latent.discrete_shapes, latent.unconstrained_shapes + latent.discrete_shapes)))


def bind_like(spec, model, first, allow_discrete=False) -> tuple:
    """``model`` bound to the arguments of the posterior's first example ``first`` as ``spec`` was.

    :raises ModelMismatchError: the model cannot be called that way.
    """
    args, kwargs = spec.build_args(first.per_example, first.shared)
    shared_names = tuple(n for n, k in zip(spec.arg_names, spec.kinds) if k == "shared")
    try:
        return bind_model(model, args, kwargs, data_plate=spec.plate, shared=shared_names,
                          allow_discrete=allow_discrete)
    except PosteriorCorrectionError as err:
        raise ModelMismatchError(f"the model cannot be called like the posterior's model: {err}") from err


def check_terms_agree(spec, other, first, data, points, rtol, where, terms=("prior", "likelihood")) -> None:
    """Refuse unless the prior term and the first example's likelihood of the two bindings agree to
    ``rtol`` (relative) at every ``(z, discrete)`` of ``points`` (probe points named by ``where``);
    ``terms`` names which of the two are compared.

    :raises ModelMismatchError: naming the term and both values.
    """
    example = tuple(x[0] for x in first.per_example)
    for z, discrete in points:
        for what, a, b in (("prior", prior_loss(spec, z, first, discrete), prior_loss(other, z, data, discrete)),
                           ("likelihood", example_loss(spec, z, example, first.shared, discrete),
                            example_loss(other, z, example, data.shared, discrete))):
            if what not in terms:
                continue
            a, b = float(a), float(b)
            if np.isfinite(a) and not abs(a - b) <= rtol * (1.0 + abs(a)):
                raise ModelMismatchError(
                    f"the model's {what} differs from the posterior's model: at {where} its negative log {what} is "
                    f"{b:.6g} where the fitted model gives {a:.6g}; a posterior can only be updated with the model "
                    "it was fitted to (refit for a new prior or likelihood).")


def forget(model: Callable, posterior, ids: Iterable[int], memory: str | Iterable[int] = "all",
           correct_prior: bool = True) -> Callable:
    """A NumPyro model (called with no arguments) whose posterior deletes ``ids`` from ``posterior``.

    Its density is the deletion objective (paper §3.2; docs/adapting.md, "Deleting data"): the deleted sites are divided out
    and the retained examples in ``memory`` are corrected; with all data retained its
    posterior is the posterior without ``ids``.
    """
    ids = as_ids(ids)
    check_same_model(model, posterior)
    require_fixed_point(posterior, "pc.handlers.forget")
    extra = correction_factor(posterior, memory, correct_prior, removed=ids)
    spec, held = posterior.spec, posterior.num_retained
    if not held:
        raise InvalidOptionError("forget needs at least one retained example to call the model for its latent sites")
    shape_args = take_data(posterior.data, np.zeros(1, np.int64))
    args, kwargs = spec.build_args(shape_args.per_example, shape_args.shared)

    def latents_only() -> Any:
        # the model runs on one retained example only to declare its latent sites; its
        # observations are masked out (the deletion objective has no likelihood of its own)
        with _drop_observations():
            return model(*args, **kwargs)

    return posterior_prior(latents_only, posterior, extra)
