r"""Per-example influence: how the posterior mean (or a function of it) moves when one example goes.

Three estimators of ``Δ_i = m_{∖i} − m`` for every example at once, the deletion methods
of :mod:`numpyro_pc.ops.unlearning` vectorised (paper §3.2):

``"remove_site"``
    the memory-perturbation equation ``Δ_i = (S − Ĥ_i)⁻¹ g_i`` (rank-``k`` downdates of
    one Cholesky factor, :mod:`numpyro_pc.criticism.cavity`);
``"influence"``
    the influence function with the Hessian at the mean, ``Δ_i = (H − H_i)⁻¹ ∇ℓ_i(m)``
    (paper eq. ``if_deriv``), the same downdates applied to ``H = ∇²ℓ_0(m) + Σ_j ∇²ℓ_j(m)``;
``"tracin"``
    ``Δ_i = ∇ℓ_i(m)`` (paper eq. ``tracin_deriv``).

With ``fn`` the change of a user function of the constrained parameters is reported too,
``f(T(m + Δ_i)) − f(T(m))`` (plug-in at the mean), e.g. a prediction at a test input.

An :class:`~numpyro_pc.EFPosterior` reports the change of each latent site's posterior mean
instead, by its exact cavity ``λ + g_i`` and that cavity's first-order form
(:func:`~numpyro_pc.criticism.ef_cavity.ef_influence`); TracIn has no meaning there.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.families.registry import FullGaussian, Gaussian
from numpyro_pc.model.likelihood import constrain
from numpyro_pc.model.rows import positions
from numpyro_pc.protocols.capabilities import SiteSum, require
from numpyro_pc.protocols.posterior import by_site_table
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expectations import get_rule
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.sites.gaussian import compute_sites

from ..errors import InvalidOptionError, NotPositiveDefiniteError
from .cavity import cavities, downdates, kl_shape
from .ef_cavity import EF_ESTIMATORS, ef_influence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["influence", "InfluenceResult", "ESTIMATORS"]

ESTIMATORS = ("remove_site", "influence", "tracin")


class InfluenceResult(NamedTuple):
    """Per-example parameter changes by each estimator.

    :ivar ids: ``(N,)`` example ids.
    :ivar delta: ``{estimator: (N, d)}`` changes of the flat unconstrained mean.
    :ivar function: ``{estimator: (N, ...)}`` changes of ``fn``, or ``None`` without ``fn``.
    :ivar khat: ``(N,)`` reliability ``k̂_i`` of site removal (see :mod:`numpyro_pc.criticism.cavity`).
    :ivar labels: names of the ``d`` coordinates (:meth:`~numpyro_pc.model.latent.LatentSpace.labels`).
    """

    ids: np.ndarray
    delta: dict
    function: dict | None
    khat: np.ndarray
    labels: tuple

    def norm(self, estimator="remove_site") -> np.ndarray:
        """``‖Δ_i‖`` per example."""
        return np.linalg.norm(self.delta[estimator], axis=1)


def _delta_sites(post, data) -> tuple[Any, Any]:
    """Gradients and (factorised where exact) Hessians of every example at the mean, and ``H``."""
    q = Gaussian(post.state.mean, jnp.eye(post.dim, dtype=post.state.mean.dtype))
    spec = replace(post.spec, num_examples=int(data.per_example[0].shape[0]))
    sites, sums = compute_sites(spec, data, FullGaussian(), q, get_rule("delta"), need_hessian_sum=True)
    hessian = sums.hessian + sites.prior_curvature_dense()
    return sites, hessian


@partial(jax.jit, static_argnames=("spec",))
def _function_change(spec, fn, mean, deltas, data):
    base = fn(constrain(spec, mean, data))
    return jax.lax.map(lambda dm: jax.tree.map(lambda a, b: a - b, fn(constrain(spec, mean + dm, data)), base),
                       deltas, batch_size=256)


def influence(post, fn=None, estimators=None) -> InfluenceResult:
    """Per-example change of the posterior mean for every example with retained data.

    :param post: a :class:`~numpyro_pc.DualPosterior` (changes of the flat unconstrained
        mean), or an :class:`~numpyro_pc.EFPosterior` (changes of each latent site's
        posterior mean of its constrained value; see
        :func:`~numpyro_pc.criticism.ef_cavity.ef_influence`).
    :param callable fn: optional function of the constrained parameters (a dict
        ``{site: value}``, as one draw of :meth:`~numpyro_pc.DualPosterior.sample`)
        returning an array; its change is reported per example and estimator.
    :param estimators: any of ``"remove_site"``, ``"influence"``, ``"tracin"``; default:
        every estimator the posterior has (an exponential-family posterior has no TracIn).
    :return: :class:`InfluenceResult`.
    :raises NotPositiveDefiniteError: the Hessian at the mean (influence) is not positive
        definite, or a site removal leaves an indefinite precision.
    :raises UnsupportedGuideError: an estimator without meaning for the posterior's family.
    """
    estimators = None if estimators is None else tuple(estimators)
    unknown = [e for e in estimators or () if e not in ESTIMATORS]
    if unknown or estimators == ():
        raise InvalidOptionError(f"unknown estimator(s) {unknown}; expected a non-empty subset of {ESTIMATORS}")
    return _influence(post, fn, estimators)


_influence = by_site_table("pc.influence")


@_influence.register(EFSiteTable)
def _ef_influence(post, fn, estimators) -> InfluenceResult:
    return InfluenceResult(*ef_influence(post, fn, EF_ESTIMATORS if estimators is None else estimators))


@_influence.register(Sites)
def _gaussian_influence(post, fn, estimators) -> InfluenceResult:
    require(post.family, SiteSum, "pc.influence")
    estimators = ESTIMATORS if estimators is None else estimators
    dtype = post.state.mean.dtype
    with jax.enable_x64(dtype == jnp.float64):
        ids = np.asarray(post.data_ids)
        rows = positions(np.asarray(post.sites.ids), ids)
        data = post.data
        delta, khat = {}, None
        if "remove_site" in estimators:
            cav = cavities(post, post.sites.take(rows), data, predict=False)
            khat = kl_shape(np.asarray(cav.kl))
            delta["remove_site"] = np.asarray(cav.shift)
            bad = ~np.all(np.isfinite(delta["remove_site"]), axis=1) | (np.asarray(cav.leverage) >= 1.0)
            if bad.any():
                raise NotPositiveDefiniteError(f"removing the site of example(s) {ids[bad][:10].tolist()} leaves a "
                                               "precision that is not positive definite (k̂ ≥ 1)")
        if "influence" in estimators or "tracin" in estimators:
            sites, hessian = _delta_sites(post, data)
            if "tracin" in estimators:
                delta["tracin"] = np.asarray(sites.dense_grad())
            if "influence" in estimators:
                if not bool(FullGaussian().is_positive_definite(hessian)):
                    raise NotPositiveDefiniteError("the Hessian of the negative log joint at the mean is not positive "
                                                   "definite; the influence function is undefined there")
                state = Gaussian(post.state.mean, hessian)
                out = downdates(post.spec, get_rule("delta"), FullGaussian(), state, sites, data, predict=False)
                delta["influence"] = np.asarray(out.shift)
                if not np.all(np.isfinite(delta["influence"])):
                    raise NotPositiveDefiniteError("the Hessian without some example is not positive definite")
        if khat is None:
            khat = kl_shape(np.asarray(cavities(post, post.sites.take(rows), data, predict=False).kl))
        function = None
        if fn is not None:
            spec = replace(post.spec, num_examples=int(ids.size))
            function = {e: jax.tree.map(np.asarray, _function_change(spec, jax.tree_util.Partial(fn), post.state.mean,
                                                                     jnp.asarray(d), data))
                        for e, d in delta.items()}
    return InfluenceResult(ids, {e: delta[e] for e in estimators}, function, khat, tuple(post.latent.labels()))
