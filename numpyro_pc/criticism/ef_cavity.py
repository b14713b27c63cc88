r"""Leave-one-out cavities of an exponential-family product posterior, and LOO over them.

In a minimal exponential family the site of example ``i`` is linear in the sufficient
statistics, :math:`\hat\ell_i(x) = \langle g_i, T(x)\rangle`, and the posterior is
:math:`\lambda = -g_0 - \sum_j g_j` (:mod:`numpyro_pc.sites.expfam`). Removing the site leaves
the cavity (paper §3.2, the memory-perturbation equation in natural parameters)

.. math::

    \lambda_{\setminus i} = \lambda + g_i ,

one vector addition per example — no matrix is downdated. It is the exact leave-one-out
posterior when the retained sites do not depend on ``q`` (every conjugate pair, where the
sites are exact constants); otherwise the retained sites are stale by as much as the
cavity moved, which is what the reliability measures. A cavity outside the family's
domain (a Beta or Gamma shape, a Dirichlet concentration that is no longer positive; a
Gaussian block's precision that is no longer positive definite) is not a distribution:
its ``k̂`` is 1.

**Reliability.** As for Gaussian cavities (:mod:`numpyro_pc.criticism.cavity`),
:math:`KL(q_{\setminus i} \| q)` in closed form,
:math:`A(\lambda) - A(\lambda_{\setminus i}) - \langle \lambda - \lambda_{\setminus i},
\mu_{\setminus i}\rangle`, mapped to the leverage of a pure-variance removal with the same
KL (:func:`~numpyro_pc.criticism.cavity.kl_shape`).

**Predictive densities** :math:`\log E_{q_{\setminus i}}[p(y_i \mid x)]` use the
posterior's own points (:func:`numpyro_pc.sites.expfam.design`) placed at each cavity: the
tensor Gauss rule of the factors that have one (exact for a likelihood polynomial in the
factor's variable, e.g. Bernoulli under a Beta), the fixed draws of the others — also for
Gaussian blocks whose sites use the degree-3 cubature (``"cubature"``), because a predictive
density is no low-degree polynomial.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.model.likelihood import ModelData, example_loss
from numpyro_pc.dual.expfam_adapt import split_frozen
from numpyro_pc.sites.expfam import design, model_point, point_losses

from ..errors import NonFiniteResultError, NotPositiveDefiniteError, UnsupportedGuideError
from .cavity import kl_shape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["EFCavities", "EF_ESTIMATORS", "ef_block_density", "ef_cavities", "ef_influence", "ef_num_points",
           "ef_predictive", "ef_loo_values", "mean_labels", "retained_grads"]

_ROWS_PER_BATCH = 64  # examples whose points are evaluated at once (memory: rows × points × model)


class EFCavities(NamedTuple):
    """The cavities of every example: ``natural (N, P)``, ``inside (N,)`` (a distribution),
    ``kl (N,)`` :math:`KL(q_{\\setminus i} \\| q)` (``inf`` outside the domain)."""

    natural: jax.Array
    inside: jax.Array
    kl: jax.Array


def ef_cavities(post) -> EFCavities:
    """The cavities :math:`\\lambda + g_i` of the examples whose data an
    :class:`~numpyro_pc.dual.expfam.EFPosterior` retains, in :attr:`data_ids` order (every example's
    unless an update dropped data)."""
    return _cavities(post.family, post.natural, retained_grads(post))


def retained_grads(post) -> jax.Array:
    """The sites :math:`g_i` of the retained examples, rows in ``post.data_ids`` order."""
    if post.num_retained == post.num_examples:
        return post.sites.grads
    return post.sites.grads[split_frozen(post)[0]]


@partial(jax.jit, static_argnums=0)
def _cavities(family, lam, grads) -> EFCavities:
    natural = lam[None, :] + grads
    inside = jax.vmap(family.in_domain)(natural)
    safe = jnp.where(inside[:, None], natural, lam[None, :])  # no NaN from A outside its domain
    kl = jax.vmap(lambda cav: family.kl(cav, lam))(safe)
    return EFCavities(natural, inside, jnp.where(inside, kl, jnp.inf))


@partial(jax.jit, static_argnums=0)
def _row_predictive(config, naturals, per_example, shared) -> jax.Array:
    """``log E_{q(λ_r)}[p(y_r | x)]`` for each row ``r`` of ``naturals`` with its own example."""
    spec, family = config.spec, config.family

    def one(args) -> jax.Array:
        lam, example = args
        values, weights = design(config, lam, cubature=False)

        def loss(point) -> jax.Array:
            z, discrete, _ = model_point(spec, family, point)
            return example_loss(spec, z, example, shared, discrete)

        losses = jax.vmap(loss)(values)
        return jax.nn.logsumexp(-losses, b=weights)

    return jax.lax.map(one, (naturals, per_example), batch_size=_ROWS_PER_BATCH)


def ef_predictive(post, naturals, rows) -> np.ndarray:
    """Predictive log densities of the examples at positions ``rows`` of ``post.data``, each under
    the distribution of the matching row of ``naturals`` (``(len(rows), P)``), in float64."""
    per_example = jax.tree.map(lambda x: jnp.asarray(x)[np.asarray(rows)], post.data.per_example)
    values = _row_predictive(post.config, jnp.asarray(naturals), per_example, post.data.shared)
    return np.asarray(values, np.float64)


def ef_loo_values(post, method: str, chosen, tol: float | None, max_iters: int) -> tuple:
    """Pointwise LOO pieces of an exponential-family posterior for :func:`numpyro_pc.criticism.loo`.

    :param str method: ``"remove_site"`` or ``"corrected"`` (``"taylor"`` is refused: it is
        a second-order expansion in a Gaussian's mean, and these sites are linear in ``T``).
    :param chosen: a function of ``(ids, khat)`` giving the rows to refit (``"corrected"``).
    :return: ``(ids, pointwise, lppd, khat, kl, refit mask, points per predictive)``.
    :raises NotPositiveDefiniteError: a cavity outside the family's domain that is not refitted.
    """
    if method == "taylor":
        raise UnsupportedGuideError(
            "method='taylor' moves a Gaussian cavity by the retained sites' total expanded to second order in its "
            "mean; an exponential-family product's sites are already linear in its sufficient statistics T(x), so "
            "there is nothing to expand. Use method='remove_site' (exact when the retained sites are conjugate) "
            "or method='corrected' (exact refits).")
    ids = np.asarray(post.data_ids)
    rows = np.arange(ids.size)
    with jax.enable_x64(post.natural.dtype == jnp.float64):
        cav = ef_cavities(post)
        inside = np.asarray(cav.inside)
        kl = np.asarray(cav.kl, np.float64)
        khat = kl_shape(kl)
        naturals = np.where(inside[:, None], np.asarray(cav.natural), np.asarray(post.natural)[None, :])
        pointwise = np.where(inside, ef_predictive(post, naturals, rows), np.nan)
        losses, weights = _losses_at(post.config, post.natural, post.data.per_example, post.data.shared)
        lppd = np.asarray(jax.nn.logsumexp(-losses, b=weights, axis=1), np.float64)  # one design at q for all
        refit = np.zeros(ids.size, bool)
        if method == "corrected":
            picked = chosen(ids, khat)
            if picked.size:
                if tol is None:  # relative to the whole posterior: the default would accept q itself
                    tol = 1e-12 if post.natural.dtype == jnp.float64 else 1e-6
                refits = [post.delete([int(i)], method="corrected", tol=tol, max_iters=max_iters).natural
                          for i in ids[picked]]  # host loop over the few refitted examples: one solve each
                pointwise[picked] = ef_predictive(post, jnp.stack(refits), picked)
                refit[picked] = True
                if not np.all(np.isfinite(pointwise[picked])):
                    raise NotPositiveDefiniteError("an exact refit gave a non-finite predictive density for "
                                                   f"example(s) {ids[picked][~np.isfinite(pointwise[picked])][:10]}")
        points = ef_num_points(post)
    outside = ~refit & ~inside
    if outside.any():
        raise NotPositiveDefiniteError(
            f"removing the site of example(s) {ids[outside][:10].tolist()} leaves natural parameters outside the "
            "family's domain (a shape or concentration that is not positive: the example carries most of that "
            "parameter's information); refit them exactly with pc.loo(post, method='corrected', where=ids).")
    bad = ~refit & ~np.isfinite(pointwise)
    if bad.any():
        raise NonFiniteResultError(f"the leave-one-out predictive density of example(s) {ids[bad][:10].tolist()} is "
                                   "not finite under a cavity inside the family's domain; check the model's "
                                   "likelihood at those observations")
    if not np.all(np.isfinite(lppd)):
        raise NotPositiveDefiniteError("the in-sample predictive density is not finite for some examples; check "
                                       "the posterior (post.residual)")
    return ids, pointwise, lppd, khat, kl, refit, points


EF_ESTIMATORS = ("remove_site", "influence")


def _flat_mean(family, lam) -> jax.Array:
    """Every latent site's :math:`E_q[x]` (constrained values) as one flat vector."""
    return jnp.concatenate([jnp.ravel(v) for v in family.mean(lam).values()])


@partial(jax.jit, static_argnums=0)
def _mean_shifts(family, lam, naturals) -> jax.Array:
    """``E_{λ_i}[x] − E_λ[x]`` for each row ``λ_i`` of ``naturals``."""
    return jax.vmap(lambda c: _flat_mean(family, c))(naturals) - _flat_mean(family, lam)[None, :]


@partial(jax.jit, static_argnums=0)
def _mean_tangents(family, lam, directions) -> jax.Array:
    """``d/dt E_{λ + t g_i}[x]`` at ``t = 0`` for each row ``g_i`` of ``directions``."""
    return jax.vmap(lambda g: jax.jvp(lambda t: _flat_mean(family, t), (lam,), (g,))[1])(directions)


def _unflatten(like, flat):
    out, pos = {}, 0
    for name, value in like.items():
        size = int(np.prod(np.shape(value), dtype=int))
        out[name] = jnp.reshape(flat[pos:pos + size], np.shape(value))
        pos += size
    return out


def mean_labels(family, lam) -> tuple:
    """Labels of the flat posterior means, e.g. ``"pi[2]"`` (scalar sites by their name)."""
    out = []
    for name, value in family.mean(lam).items():
        shape = np.shape(value)
        out.extend([name] if shape == () else [f"{name}[{','.join(map(str, i))}]" for i in np.ndindex(*shape)])
    return tuple(out)


def ef_influence(post, fn, estimators) -> tuple:
    r"""Per-example change of every latent site's posterior mean :math:`E_q[x]` (constrained values).

    ``"remove_site"``: :math:`E_{\lambda + g_i}[x] - E_\lambda[x]`, the cavity's mean (exact
    leave-one-out for conjugate pairs); ``"influence"``: its first-order form
    :math:`\tfrac{d}{dt} E_{\lambda + t g_i}[x]\big|_{t=0}`, the infinitesimal jackknife in natural
    parameters (one Jacobian–vector product per example). ``"tracin"`` is refused: it is a
    gradient step from a point estimate in the model's unconstrained coordinates, and these
    posteriors live in natural parameters over the sites' own values, where removing a site is
    exact (:math:`\Delta\lambda = g_i`).

    :return: ``(ids, {estimator: (N, D)}, {estimator: fn changes} or None, khat (N,), labels)``;
        ``fn`` is applied to the dict of posterior means (plug-in, as the Gaussian path applies
        it at the constrained mean).
    :raises UnsupportedGuideError: ``"tracin"`` among ``estimators``.
    :raises NotPositiveDefiniteError: a cavity outside the family's domain (``"remove_site"``).
    """
    if "tracin" in estimators:
        raise UnsupportedGuideError(
            "the TracIn estimator is a gradient step from a point estimate in the model's unconstrained coordinates; "
            "an exponential-family posterior lives in natural parameters over its sites' own values, where removing "
            "a site is exact (Δλ = g_i). Use estimators=('remove_site', 'influence').")
    family, lam = post.family, post.natural
    ids = np.asarray(post.data_ids)
    with jax.enable_x64(lam.dtype == jnp.float64):
        cav = ef_cavities(post)
        khat = kl_shape(np.asarray(cav.kl, np.float64))
        base = _flat_mean(family, lam)
        delta = {}
        if "remove_site" in estimators:
            inside = np.asarray(cav.inside)
            if not inside.all():
                raise NotPositiveDefiniteError(
                    f"removing the site of example(s) {ids[~inside][:10].tolist()} leaves natural parameters outside "
                    "the family's domain (k̂ = 1); estimators=('influence',) gives the first-order change")
            delta["remove_site"] = np.asarray(_mean_shifts(family, lam, cav.natural))
        if "influence" in estimators:
            delta["influence"] = np.asarray(_mean_tangents(family, lam, retained_grads(post)))
        for name, values in delta.items():
            if not np.all(np.isfinite(values)):
                raise NotPositiveDefiniteError(f"the {name!r} change of some posterior means is not finite")
        function = None
        if fn is not None:
            like = family.mean(lam)
            start = fn(like)

            def change(d) -> jax.Array:
                return jax.tree.map(lambda a, b: a - b, fn(_unflatten(like, base + d)), start)

            function = {e: jax.tree.map(np.asarray, jax.lax.map(change, jnp.asarray(d), batch_size=256))
                        for e, d in delta.items()}
    return ids, {e: delta[e] for e in estimators}, function, khat, mean_labels(family, lam)


@partial(jax.jit, static_argnums=0)
def _losses_at(config, lam, per_example, shared) -> tuple[Any, Any]:
    """The posterior's points at ``lam``: every example's loss there ``(N, S)`` and their weights ``(S,)``."""
    values, weights = design(config, lam, cubature=False)
    losses, _ = point_losses(config.spec, config.family, values, ModelData(per_example, shared))
    return losses, weights


def ef_block_density(post, block) -> float:
    r""":math:`\log E_q[\prod_{j \in block} p(y_j \mid x)]` of examples ``block``
    (:class:`~numpyro_pc.model.likelihood.ModelData`) not necessarily in ``post``, under the
    posterior's own points (the joint density of a forecast horizon in
    :func:`numpyro_pc.criticism.lfo`)."""
    with jax.enable_x64(post.natural.dtype == jnp.float64):
        losses, weights = _losses_at(post.config, post.natural, block.per_example, block.shared)
        return float(jax.nn.logsumexp(-jnp.sum(losses, 0), b=weights))


def ef_num_points(post) -> int:
    """How many points stand for ``q`` (the ``n_samples`` of an ELPD result; traced, not run)."""
    with jax.enable_x64(post.natural.dtype == jnp.float64):
        return int(jax.eval_shape(lambda lam: design(post.config, lam, cubature=False)[1], post.natural).shape[0])
