r"""Correction terms of an exponential-family posterior, for :mod:`numpyro_pc.handlers`.

For :class:`~numpyro_pc.ef_posterior.EFPosterior` the site of example :math:`i` is linear in
the sufficient statistics, :math:`\hat\ell_i(x) = \langle T(x), g_i\rangle`, and
:math:`q(x) \propto e^{-\hat\ell_0(x) - \sum_i \hat\ell_i(x)}` (docs/expfam.md). The corrected
objectives of paper §3.1–3.2 are then

.. math::

    q(x)\, e^{-(\ell_0(x) - \hat\ell_0(x))} \prod_{i\in C} e^{-(\ell_i(x) - \hat\ell_i(x))}
    \prod_{j \in J} e^{\hat\ell_j(x)},

all terms evaluated in the factors' own coordinates (constrained values, unconstrained
values for Gaussian factors, integers for discrete ones): a ratio of two densities in the same
coordinates is a function of the latent values, whatever the coordinates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .ef_eval import factor_prior_loss
from .ef_posterior import site_names
from .ef_sites import model_point
from .errors import ModelMismatchError, PosteriorCorrectionError
from .likelihood import ModelData, bind_model, example_loss, prior_loss
from .rowops import as_ids, take_rows
from .rows import memory_ids, positions

__all__ = ["ef_correction_factor", "factor_point", "check_same_ef_model", "bind_like", "check_terms_agree"]


def factor_point(post, values):
    """The factors' coordinates of a dict of the model's latent site values."""
    return {f.site: f.from_constrained(jnp.asarray(values[f.site])) for f in post.family.factors}


def ef_correction_factor(post, memory="all", correct_prior=True, removed=()):
    """``point ↦`` the log-density of the correction terms at factor coordinates ``point``:
    ``−Σ_{i∈C}(ℓ_i − ℓ̂_i)``, ``−(ℓ_0 − ℓ̂_0)`` when ``correct_prior``, ``+Σ_{j∈removed} ℓ̂_j``.

    :param memory: ``"all"`` retained examples, ``"none"``, or a list of ids.
    """
    held = np.asarray(post.ids)
    removed = np.asarray(as_ids(removed) if len(removed) else np.zeros(0, np.int64))
    ids = memory_ids(memory, held, removed)
    rows = positions(held, ids, "retained example")
    gone = positions(held, removed, "retained example")
    spec, family, data = post.config.spec, post.family, post.data
    memory_data = ModelData(tuple(take_rows(x, rows) for x in data.per_example), data.shared)
    memory_site = jnp.sum(post.state.grads[rows], 0)
    removed_site = jnp.sum(post.state.grads[gone], 0)

    def log_density(point):
        stats = family.stats({k: jnp.asarray(v)[None] for k, v in point.items()})[0]
        total = stats @ removed_site
        if rows.size:
            z, discrete, _ = model_point(spec, family, point)
            per = jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared, discrete))(memory_data.per_example)
            total = total - (jnp.sum(per) - stats @ memory_site)
        if correct_prior:
            total = total - (factor_prior_loss(spec, family, point, data) - stats @ post.state.prior)
        return total

    return log_density



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


def check_terms_agree(spec, other, first, data, points, rtol, where) -> None:
    """Refuse unless the prior term and the first example's likelihood of the two bindings agree to
    ``rtol`` (relative) at every ``(z, discrete)`` of ``points`` (probe points named by ``where``).

    :raises ModelMismatchError: naming the term and both values.
    """
    example = tuple(x[0] for x in first.per_example)
    for z, discrete in points:
        for what, a, b in (("prior", prior_loss(spec, z, first, discrete), prior_loss(other, z, data, discrete)),
                           ("likelihood", example_loss(spec, z, example, first.shared, discrete),
                            example_loss(other, z, example, data.shared, discrete))):
            a, b = float(a), float(b)
            if np.isfinite(a) and not abs(a - b) <= rtol * (1.0 + abs(a)):
                raise ModelMismatchError(
                    f"the model's {what} differs from the posterior's model: at {where} its negative log {what} is "
                    f"{b:.6g} where the fitted model gives {a:.6g}; a posterior can only be updated with the model "
                    "it was fitted to (refit for a new prior or likelihood).")

def check_same_ef_model(model, post, num_probes=3):
    """Refuse ``model`` unless it is the posterior's model (latent sites and shapes, prior term and
    per-example likelihood at draws of ``post``, to 1e-8 relative in float64).

    :raises ModelMismatchError: naming what differs.
    """
    spec = post.config.spec
    if model is spec.model or post.num_examples == 0:
        return
    first = ModelData(tuple(take_rows(x, np.zeros(1, np.int64)) for x in post.data.per_example), post.data.shared)
    other, data = bind_like(spec, model, first, allow_discrete=True)
    if site_names(other) != site_names(spec) or other.latent.shapes != spec.latent.shapes:
        raise ModelMismatchError(f"the model's latent sites {list(site_names(other))} differ from the posterior's "
                                 f"{list(site_names(spec))} (names and shapes)")
    rtol = 1e-8 if post.natural.dtype == jnp.float64 else 1e-4
    draws = post.family.sample(jax.random.PRNGKey(7), post.natural, num_probes)
    points = [model_point(spec, post.family, {name: v[k] for name, v in draws.items()})[:2] for k in range(num_probes)]
    check_terms_agree(spec, other, first, data, points, rtol, "a draw of the posterior")
