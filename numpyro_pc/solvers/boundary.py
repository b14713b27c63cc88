r"""Fixed points at the boundary of a constrained latent: a collapsed scale is a local optimum.

A variational fit started from somewhere else than the package's default start — an SVI
solution handed to :func:`numpyro_pc.dual_form` — can converge to a stationary point where a
scale or variance has collapsed towards ``0`` (its unconstrained value ``log σ`` far below
anything its prior expects) and the latents it scales have frozen. The dual-form fixed point
there is genuine (the residual is small) but the posterior is not the one the user wants: the
ELBO is far lower than at the optimum that :func:`numpyro_pc.fit` finds. Measured on
UC Berkeley admissions with a correlated varying intercept and slope (LKJ-Cholesky, d = 17,
NumPyro's ``ucbadmit`` example's model): SVI with ``AutoNormal`` puts ``sigma[0]`` at 0.002,
and the refined dual form of that guide scores 214 nats on the variational objective against
88 for the default start and 78 for ``pc.fit`` with the same diagonal family (one set of fixed
draws; other seeds move each score by 1–3 nats).

:func:`check_boundary` decides in two steps, so that a scale that is truly small is never
called a mistake:

1. **Flag.** Coordinates of a constrained site (positive, interval, correlation, simplex …:
   any site whose support is not the real line) whose posterior mean in unconstrained space
   lies outside the central 98 % of the prior's draws of that coordinate
   (:data:`PRIOR_QUANTILE` on each side). Nothing flagged: nothing else is computed.
2. **Compare.** Only then is the default start of :func:`numpyro_pc.fit`
   (:func:`~numpyro_pc.solvers.start.default_start`: MAP/Laplace, or the mean-field ELBO start, in the
   posterior's own family) scored against the posterior on the same fixed draws of the
   variational objective :func:`~numpyro_pc.solvers.start.fixed_draw_objective` (lower is better).
   A start better by more than :data:`OBJECTIVE_MARGIN` nats proves the posterior is not the
   family's optimum, and a :class:`~numpyro_pc.errors.BoundaryOptimumWarning` says which
   coordinates, both scores and what to try.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform, biject_to

from numpyro_pc.errors import BoundaryOptimumWarning, PosteriorCorrectionError

from .start import default_start, fixed_draw_objective

__all__ = ["BoundaryCheck", "check_boundary", "flag_boundary_coordinates", "warn_if_worse_optimum",
           "PRIOR_QUANTILE", "OBJECTIVE_MARGIN", "PRIOR_DRAWS"]

PRIOR_QUANTILE = 0.01  # a posterior mean beyond the prior's 1 % (or 99 %) quantile is flagged
OBJECTIVE_MARGIN = 1.0  # nats: a default start better than this proves a worse optimum (draw noise ≈ 0.1–3 nats)
PRIOR_DRAWS = 1000


class BoundaryCheck(NamedTuple):
    """What :func:`check_boundary` found (``record["boundary"]`` of a dual form holds it as a dict).

    :ivar tuple flagged: labels of the flagged coordinates (e.g. ``"sigma[0]"``).
    :ivar tuple means: their posterior means in unconstrained space.
    :ivar tuple prior_ranges: the prior's ``(1 %, 99 %)`` quantiles of each, unconstrained.
    :ivar float objective: the posterior's variational objective (``nan`` when nothing was flagged).
    :ivar float start_objective: the default start's, on the same draws (``nan`` when not computed).
    :ivar str start_kind: which default start was scored (``"map"``, ``"elbo"``, ``"prior"``; ``""`` if none).
    :ivar bool worse_optimum: whether the start beat the posterior by more than :data:`OBJECTIVE_MARGIN`.
    :ivar str skipped: why no check was possible (``""`` when it ran).
    """

    flagged: tuple = ()
    means: tuple = ()
    prior_ranges: tuple = ()
    objective: float = float("nan")
    start_objective: float = float("nan")
    start_kind: str = ""
    worse_optimum: bool = False
    skipped: str = ""

    def as_record(self) -> dict:
        """A JSON-friendly dict of the fields (``None`` for a score not computed)."""
        def number(x) -> float | None:
            return float(x) if np.isfinite(x) else None

        return dict(flagged=list(self.flagged), means=[float(m) for m in self.means],
                    prior_ranges=[[float(a), float(b)] for a, b in self.prior_ranges],
                    objective=number(self.objective), start_objective=number(self.start_objective),
                    start_kind=self.start_kind, worse_optimum=bool(self.worse_optimum), skipped=self.skipped)


def _constrained(transform) -> bool:
    """Whether a site's bijection to the real line is not the identity (``real`` and ``real_vector`` are)."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return not isinstance(transform, IdentityTransform)


@partial(jax.jit, static_argnames=("spec", "num"))
def _draws_on(spec, per_example, shared, key, num) -> jax.Array:
    args, kwargs = spec.build_args(per_example, shared)
    names = [n for n, t in zip(spec.latent.names, spec.latent.transforms) if _constrained(t)]

    def one(draw_key) -> jax.Array:
        with handlers.block():
            trace = handlers.trace(handlers.seed(spec.model, draw_key)).get_trace(*args, **kwargs)
        # each draw's own support: a bound that is itself a latent (Uniform(0, top)) moves with it
        return jnp.concatenate([jnp.reshape(biject_to(trace[n]["fn"].support).inv(trace[n]["value"]), (-1,))
                                for n in names])

    return jax.vmap(one)(jax.random.split(key, num))


def _constrained_coordinates(latent) -> np.ndarray:
    """A boolean mask over the flat coordinates: ``True`` where the site's support is not the real line."""
    mask = [np.full(size, _constrained(transform), bool) for size, transform in zip(latent.sizes, latent.transforms)]
    return np.concatenate(mask) if mask else np.zeros(0, bool)


def flag_boundary_coordinates(spec, data, mean, num_draws: int = PRIOR_DRAWS, seed: int = 0) -> BoundaryCheck:
    """Step 1 of :func:`check_boundary`: constrained coordinates whose mean lies beyond the prior's quantiles.

    The prior's draws come from running the model on its first example with a seed (one
    compiled program per model and number of draws; only the constrained sites' coordinates
    are kept). They ignore ``numpyro.factor`` terms, so the range is that of the sample
    statements' prior — a heuristic gate, not a test: nothing is warned about without the
    objective comparison of step 2. A prior with no sampler (``ImproperUniform``, the flat
    priors of Stan programs) has no range: the check is skipped and ``skipped`` says why.

    :param spec: the bound model (:func:`~numpyro_pc.model.likelihood.bind_model`).
    :param data: its data.
    :param mean: the posterior mean, flat and unconstrained.
    :param int num_draws: prior draws used for the quantiles.
    :param int seed: seed of the prior draws.
    :rtype: BoundaryCheck
    """
    constrained = _constrained_coordinates(spec.latent)
    if not constrained.any():
        return BoundaryCheck()
    try:
        draws = np.asarray(_draws_on(spec, tuple(x[:1] for x in data.per_example), data.shared,
                                     jax.random.PRNGKey(seed % 2**32), num_draws))
    except Exception as err:  # noqa: BLE001 - a prior that cannot be sampled leaves nothing to compare with
        return BoundaryCheck(skipped=f"the prior could not be sampled ({type(err).__name__}: {str(err)[:120]})")
    # inverted_cdf keeps infinite draws as they are (a Gamma(0.001, 0.001) prior puts half its draws at
    # log x = -inf in float64): interpolating between them would give NaN and switch the check off
    low, high = np.nanquantile(draws, [PRIOR_QUANTILE, 1.0 - PRIOR_QUANTILE], axis=0, method="inverted_cdf")
    mean = np.asarray(mean)[constrained]
    where = np.flatnonzero((mean < low) | (mean > high))
    labels = [label for label, keep in zip(spec.latent.labels(), constrained) if keep]
    return BoundaryCheck(tuple(labels[j] for j in where), tuple(float(mean[j]) for j in where),
                         tuple((float(low[j]), float(high[j])) for j in where))


def check_boundary(spec, data, family, q, num_draws: int = PRIOR_DRAWS, seed: int = 0) -> BoundaryCheck:
    """Whether ``q`` sits at a collapsed-scale optimum that the default start of :func:`numpyro_pc.fit` beats.

    See the module docstring for the two steps. The comparison costs one default-start search
    (a MAP and possibly a mean-field ELBO fit) and is run only when a coordinate is flagged.

    :param spec: the bound model.
    :param data: its data.
    :param family: the posterior's Gaussian family (the start is computed in it).
    :param q: the posterior's Gaussian state.
    :param int num_draws: prior draws used for the quantiles.
    :param int seed: seed of the prior draws and of the objective's fixed draws.
    :rtype: BoundaryCheck
    """
    seed = seed % 2**32
    found = flag_boundary_coordinates(spec, data, q.mean, num_draws, seed)
    if not found.flagged:
        return found
    objective = fixed_draw_objective(spec, data, family, q, seed=seed)
    try:
        start = default_start(spec, data, family, None, q.mean.dtype)
    except PosteriorCorrectionError:  # no usable default start: nothing to compare with
        return found._replace(objective=objective)
    start_objective = fixed_draw_objective(spec, data, family, start.start, seed=seed)
    worse = bool(np.isfinite(start_objective) and start_objective < objective - OBJECTIVE_MARGIN)
    return found._replace(objective=objective, start_objective=start_objective, start_kind=start.kind,
                          worse_optimum=worse)


def warn_if_worse_optimum(found: BoundaryCheck, stacklevel: int = 3) -> None:
    """Issue a :class:`~numpyro_pc.errors.BoundaryOptimumWarning` when ``found.worse_optimum``."""
    if not found.worse_optimum:
        return
    shown = "; ".join(f"{label}: {mean:.3g}, outside the prior's 1–99 % range [{low:.3g}, {high:.3g}]"
                      for label, mean, (low, high) in zip(found.flagged[:4], found.means, found.prior_ranges))
    more = f" and {len(found.flagged) - 4} more" if len(found.flagged) > 4 else ""
    warnings.warn(
        "the dual form converged, but to a local optimum where a constrained latent lies far outside its "
        f"prior's range, as when a scale collapses towards 0 (posterior means in unconstrained space: {shown}{more}). "
        f"The default start of pc.fit ({found.start_kind}) scores {found.start_objective:.1f} on the variational "
        f"objective against {found.objective:.1f} for this posterior (lower is better), so this is not the family's "
        "optimum. Try pc.fit(model, ...) with the same family, or run the guide's optimiser again from another "
        "initialisation; record['boundary'] keeps these numbers.", BoundaryOptimumWarning, stacklevel=stacklevel)

