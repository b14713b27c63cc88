r"""All-``N`` leave-one-out cross-validation without refits, as an ArviZ ``ELPDData``.

:func:`loo` removes every example's site from the dual form at once
(:mod:`numpyro_pc.criticism.cavity`) and scores each example under its cavity,

.. math::

    \widehat{\mathrm{elpd}}_{loo} = \sum_{i=1}^N \log \int p(y_i \mid z)\, q_{\setminus i}(z)\, dz,
    \qquad \hat p_{loo} = \sum_i \Big(\log E_q[p(y_i\mid z)] - \log E_{q_{\setminus i}}[p(y_i\mid z)]\Big),

with the expectations taken by the posterior's own rule (``method="taylor"`` first moves each
cavity to the deletion fixed point with the retained sites' total expanded to second order
at ``q``, which removes the one-signed error of models with a learned noise scale). Each
example gets a reliability
``k̂_i`` (the Pareto shape of ``q_{∖i}/q`` with the same KL from ``q``, see
:mod:`~numpyro_pc.criticism.cavity`; stored where ArviZ keeps PSIS's ``pareto_k``, with the
raw ``leverage`` and ``kl`` beside it);
``method="corrected"`` replaces the examples in ``where`` (by default those with
``k̂_i > good_k``) by exact, warm-started refits ``post.delete([i], method="corrected")``
(paper eq. ``postcorr_influence`` with every retained example corrected).

The result subclasses :class:`arviz.ELPDData`, so ``az.compare``, ``az.plot_khat`` and
``az.plot_elpd`` take it unchanged.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.curvature.stores import FULL
from numpyro_pc.model.rows import positions, take_data
from numpyro_pc.protocols.capabilities import SiteDivision, require, site_curvature
from numpyro_pc.protocols.posterior import Posterior, by_site_table
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expfam_table import EFSiteTable

from ..errors import InvalidOptionError, NotFittedError, NotPositiveDefiniteError, UnsupportedGuideError
from ..options import check_finite, check_solver_options, is_choice
from .cavity import cavities, kl_shape, refit_predictive, rule_nodes, taylor_cavities
from .ef_cavity import ef_loo_values

if TYPE_CHECKING:
    from typing import Any

if TYPE_CHECKING:  # ArviZ is imported on first use only
    from arviz.stats.stats_utils import ELPDData

__all__ = ["loo", "LooResult", "elpd_data", "kl_shape", "METHODS", "GOOD_K"]

METHODS = ("remove_site", "taylor", "corrected")
GOOD_K = 0.7  # the threshold ArviZ uses for PSIS with many draws; k̂ ≥ 1: the cavity is not a distribution


def _elpd_base():
    from arviz.stats.stats_utils import ELPDData

    return ELPDData


def _series_class():
    base = _elpd_base()

    class LooResult(base):
        """ArviZ ``ELPDData`` with array views: ``pointwise``, ``khat``, ``flagged``, ``ids``, ``refitted``."""

        @property
        def pointwise(self) -> np.ndarray:
            """Per-example ``log p(y_i | y_{−i})`` (NumPy array)."""
            return np.asarray(self["loo_i"].values)

        @property
        def khat(self) -> np.ndarray:
            """Per-example reliability ``k̂_i`` (zeros for exact refits-only results such as LFO)."""
            return np.asarray(self["pareto_k"].values) if "pareto_k" in self else np.zeros(len(self.pointwise))

        @property
        def flagged(self):
            """Boolean mask of examples whose ``k̂_i`` exceeds ``good_k`` (cheap estimate unreliable)."""
            return self.khat > float(self["good_k"])

        @property
        def ids(self) -> np.ndarray:
            """Example ids (or, for LFO, the forecast origins) aligned with ``pointwise``."""
            return np.asarray(self["loo_i"].coords[self["loo_i"].dims[0]].values)

        @property
        def refitted(self) -> np.ndarray:
            """Mask of examples whose value comes from an exact refit."""
            return np.asarray(self["refitted"]) if "refitted" in self else np.zeros(len(self.pointwise), bool)

        def __str__(self) -> str:
            """ArviZ's summary, saying what the numbers of a dual-form LOO are: the rule's nodes
            are not posterior draws, and ``k̂`` is not PSIS's."""
            text = super().__str__()
            first, _, rest = text.partition("\n")
            if "posterior samples" in first:
                first = (f"Computed by posterior correction from {self.n_data_points} observations: each example scored "
                         f"under its cavity q_-i with the posterior's own rule ({self.n_samples} quadrature nodes "
                         "or draws, not posterior samples).")
            text = first + "\n" + rest
            if "pareto_k" in self:
                text += ("\n\nk̂ here is the Pareto shape that a proposal with the same KL(q_-i || q) would have "
                         "(numpyro_pc.criticism.cavity), not PSIS's estimate from draws: it marks the examples whose "
                         "cavity may be far from the leave-one-out posterior; method='corrected' refits them.")
            return text

        __repr__ = __str__

    return LooResult


LooResult = None  # the class is built on first use so that importing numpyro_pc does not import ArviZ


def elpd_data(pointwise, lppd, khat, ids, dim, num_draws, good_k=GOOD_K, refitted=None, method="remove_site") -> Any:
    """Package pointwise values as an ArviZ-compatible ``ELPDData`` (:class:`LooResult`).

    :param pointwise: ``(N,)`` ``log p(y_i | rest)``.
    :param lppd: ``(N,)`` in-sample ``log p(y_i | y)`` (for ``p_loo``).
    :param khat: ``(N,)`` reliability values, or ``None`` (no ``pareto_k`` entry).
    :param ids: ``(N,)`` labels of the pointwise dimension ``dim``.
    :param int num_draws: the rule's nodes or draws (ArviZ's ``n_samples``).
    """
    import xarray as xr

    global LooResult
    if LooResult is None:
        LooResult = _series_class()
    pointwise = np.asarray(pointwise, np.float64)
    num = pointwise.size
    coords = {dim: np.asarray(ids)}
    values = [float(pointwise.sum()), float(np.sqrt(num * np.var(pointwise))),
              float(np.sum(np.asarray(lppd) - pointwise)), int(num_draws), int(num)]
    warning = bool(khat is not None and np.any(np.asarray(khat) > good_k))
    index = ["elpd_loo", "se", "p_loo", "n_samples", "n_data_points", "warning", "loo_i"]
    data = values + [warning, xr.DataArray(pointwise, dims=[dim], coords=coords)]
    if khat is not None:
        index.append("pareto_k")
        data.append(xr.DataArray(np.asarray(khat, np.float64), dims=[dim], coords=coords))
    index += ["scale", "good_k", "refitted", "method"]
    data += ["log", float(good_k), np.zeros(num, bool) if refitted is None else np.asarray(refitted, bool), method]
    return LooResult(data=data, index=index)


def _where_rows(where, ids, khat, good_k) -> np.ndarray:
    """Rows selected by ``where``: ``None`` (k̂ above ``good_k``), a boolean mask, or example ids."""
    if where is None:
        return np.flatnonzero(khat > good_k)
    raw = np.asarray(where)
    if raw.dtype == np.bool_:
        if raw.shape != ids.shape:
            raise InvalidOptionError(f"where= as a boolean mask needs one entry per example ({ids.size}); "
                                     f"got shape {raw.shape}")
        return np.flatnonzero(raw)
    if raw.size and not np.issubdtype(raw.dtype, np.integer):
        raise InvalidOptionError(f"where= must be a boolean mask or integer example ids; got dtype {raw.dtype}")
    return positions(ids, raw.astype(np.int64).ravel(), "example with retained data")


def loo(post, method="remove_site", where=None, good_k=GOOD_K, tol=None, max_iters=None) -> ELPDData:
    r"""Leave-one-out cross-validation of every example with retained data, without refitting.

    :param post: a fitted :class:`~numpyro_pc.DualPosterior` (full or diagonal family) or
        :class:`~numpyro_pc.EFPosterior` (cavities :math:`\lambda + g_i`, see
        :mod:`~numpyro_pc.criticism.ef_cavity`; ``leverage`` is then absent).
    :param str method: ``"remove_site"`` (default): all ``N`` cavities in one batched, jitted
        computation; ``"taylor"``: the cavities moved to the deletion fixed point with the
        retained sites' total expanded to second order at ``q`` (full family; about one
        ``pc.fit`` of extra time for small ``d``, refused for ``d ≳ 90``; see
        :func:`~numpyro_pc.criticism.cavity.taylor_cavities`); ``"corrected"``: site removal,
        then exact warm-started refits for the examples in ``where``.
    :param where: examples to refit with ``method="corrected"``: a boolean mask aligned
        with the result (e.g. ``previous.flagged``), example ids, or ``None`` (those with
        ``k̂_i > good_k``).
    :param float good_k: reliability threshold (ArviZ's ``good_k``).
    :param float tol: residual tolerance of the refits (default ``1e-12`` in float64: the
        package default ``1e-8`` is relative to the whole posterior and would accept ``q``
        itself after removing a well-fitted example).
    :param int max_iters: iterations per refit (default: automatic, see :func:`~numpyro_pc.solvers.gaussian.solve`).
    :return: a :class:`LooResult` (an ``arviz.ELPDData``); ``record``-like extras are the
        entries ``refitted`` and ``method``.
    :raises NotFittedError: the posterior has no example with retained data to leave out.
    :raises NotPositiveDefiniteError: an example's cavity is not positive definite
        (``k̂_i ≥ 1``) and it is not among the refitted ones.
    :raises UnsupportedGuideError: a posterior whose sites carry no precision (isotropic
        family), ``method="taylor"`` without a dense Gaussian covariance, or an object that
        is not a dual-form posterior.
    """
    if not is_choice(method, METHODS):
        raise InvalidOptionError(f"unknown LOO method {method!r}; expected one of {METHODS}")
    good_k = check_finite(good_k, "good_k", low=0.0)
    check_solver_options(tol, max_iters)
    if isinstance(post, Posterior) and post.num_retained == 0:
        found = (f"{post.num_examples} example(s) with a site, none with its data" if post.num_examples
                 else "no example at all (every example was deleted)")
        raise NotFittedError(f"no examples to leave out: leave-one-out needs at least one example with retained data; "
                             f"this posterior has {found}, so its elpd would be an empty sum with no standard error")
    start = time.perf_counter()
    result = _loo(post, method, where, good_k, tol, max_iters)
    result["seconds"] = time.perf_counter() - start
    return result


_loo = by_site_table("pc.loo")


@_loo.register(EFSiteTable)
def _ef_loo(post, method, where, good_k, tol, max_iters):
    ids, pointwise, lppd, khat, kl, refit, points = ef_loo_values(
        post, method, lambda ids, khat: _where_rows(where, ids, khat, good_k), tol, max_iters)
    result = elpd_data(pointwise, lppd, khat, ids, post.config.spec.plate, points, good_k, refit, method)
    result["kl"] = kl
    return result


@_loo.register(Sites)
def _gaussian_loo(post, method, where, good_k, tol, max_iters):
    require(post.family, SiteDivision, "pc.loo",
            "Fit with family='full' or 'diagonal'; pc.influence(post) still gives its parameter changes.")
    dtype = post.state.mean.dtype
    with jax.enable_x64(dtype == jnp.float64):
        ids = np.asarray(post.data_ids)
        rows = positions(np.asarray(post.sites.ids), ids)
        cav = cavities(post, post.sites.take(rows), post.data)
        leverage = np.asarray(cav.leverage)
        khat = kl_shape(np.asarray(cav.kl))
        pointwise = np.array(cav.elpd, dtype=np.float64)
        lppd = np.asarray(cav.lppd, np.float64)
        if method == "taylor":
            if site_curvature(post.family).detail != FULL:
                raise UnsupportedGuideError("method='taylor' needs the full Gaussian family (a dense covariance); "
                                            "use method='remove_site' or 'corrected'.")
            means, precisions, converged = taylor_cavities(post, post.sites.take(rows), post.data, cav.shift)
            converged = np.asarray(converged)
            moved = np.array(refit_predictive(post, post.data, means, precisions), dtype=np.float64)
            pointwise = np.where(converged, moved, pointwise)  # the others keep site removal
        refit = np.zeros(ids.size, bool)
        if method == "corrected":
            chosen = _where_rows(where, ids, khat, good_k)
            if chosen.size:
                pointwise[chosen], lppd_chosen = _refit_values(post, ids, chosen, tol, max_iters)
                refit[chosen] = True
        bad = ~refit & (~np.isfinite(pointwise) | (leverage >= 1.0))
        if bad.any():
            raise NotPositiveDefiniteError(
                f"removing the site of example(s) {ids[bad][:10].tolist()} leaves a precision that is not positive "
                f"definite (leverage {np.round(leverage[bad][:10], 3).tolist()} ≥ 1: the example carries most of the "
                "posterior's precision along its direction); refit them exactly with "
                "pc.loo(post, method='corrected', where=ids).")
        if not np.all(np.isfinite(lppd)):
            raise NotPositiveDefiniteError("the in-sample predictive density is not finite for some examples; "
                                           "check the posterior (residual, precision)")
        nodes = rule_nodes(post.rule, post.spec, post.dim, dtype)[1].shape[0]
    result = elpd_data(pointwise, lppd, khat, ids, post.spec.plate, nodes, good_k, refit, method)
    result["leverage"] = leverage
    result["kl"] = np.asarray(cav.kl)
    if method == "taylor":
        result["taylor_converged"] = converged
    return result


def _refit_values(post, ids, chosen, tol, max_iters) -> tuple[np.ndarray, None]:
    """Exact LOO predictive of the examples at ``chosen``: one warm-started corrected deletion each."""
    tol = tol if tol is not None else (1e-12 if post.state.mean.dtype == jnp.float64 else None)
    means, precisions = [], []
    for i in ids[chosen]:  # host loop over the (few) flagged examples: one solver run each
        refit = post.delete([int(i)], method="corrected", tol=tol, max_iters=max_iters)
        means.append(refit.state.mean)
        precisions.append(refit.state.precision)
    data = take_data(post.data, chosen)
    values = np.asarray(refit_predictive(post, data, jnp.stack(means), jnp.stack(precisions)), np.float64)
    if not np.all(np.isfinite(values)):
        raise NotPositiveDefiniteError("an exact refit gave a non-finite predictive density")
    return values, None
