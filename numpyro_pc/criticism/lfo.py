r"""Leave-future-out cross-validation by streaming exact updates (Bürkner, Gabry & Vehtari 2020).

For a time series of ``N`` examples (the data plate ordered in time), the ``M``-step-ahead
LFO estimate sums, over forecast origins ``i = L, L + s, L + 2s, …`` with ``i + M ≤ N``,

.. math::

    \widehat{\mathrm{elpd}}_{lfo} = \sum_i \log p(y_{i+1:i+M} \mid y_{1:i})
        = \sum_i \log E_{q_i}\Big[\prod_{j=i+1}^{i+M} p(y_j \mid y_{1:j-1}, z)\Big],

where ``q_i`` is the posterior of the first ``i`` examples (lagged values enter the
likelihood of example ``j`` as its observed covariates). The paper's exact protocol is
``s = 1``: a refit at every origin. Here ``q_{i+s}`` comes from ``q_i`` by one exact
streaming update (``correction="exact"``, paper §3.1), which reaches the batch posterior
of ``y_{1:i+s}`` without refitting; ``method="refit"`` refits with :func:`numpyro_pc.fit`
at every origin instead (the brute-force reference).

One-step predictions (``M = 1``) use the posterior's expectation rule; the joint
``M``-step density uses ``num_samples`` fixed, moment-matched draws of ``q_i`` (the
``mc`` rule's noise; the plug-in at the mean for the ``delta`` rule). With
``fit_options={"family": {site: "beta", ...}}`` the posteriors are exponential-family
products and every density uses their own points (Gauss rules or fixed draws; see
:func:`~numpyro_pc.criticism.ef_cavity.ef_block_density`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from numpyro_pc.model.likelihood import bind_model, example_loss, is_array
from numpyro_pc.protocols.posterior import by_site_table
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expectations import get_rule, mc_noise
from numpyro_pc.sites.expfam_table import EFSiteTable

from ..errors import DataShapeError, InvalidOptionError
from ..options import is_choice
from ..posterior import fit
from .cavity import refit_predictive, rule_nodes
from .ef_cavity import ef_block_density, ef_num_points
from .loo import elpd_data
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["lfo", "METHODS"]

METHODS = ("update", "refit")


def _slicer(args, kwargs) -> tuple[int, Any]:
    """``(N, take(lo, hi))``: the leading-axis slice of every per-time-step argument."""
    arrays = [a for a in list(args) + list(kwargs.values()) if is_array(a) and np.ndim(a) >= 1]
    if not arrays:
        raise DataShapeError("lfo needs the time series as array arguments with time on the leading axis")
    num = int(np.shape(arrays[0])[0])

    def cut(a, lo, hi):
        return a[lo:hi] if is_array(a) and np.ndim(a) >= 1 and np.shape(a)[0] == num else a

    def take(lo, hi) -> tuple[tuple[Any, ...], dict[Any, Any]]:
        return tuple(cut(a, lo, hi) for a in args), {k: cut(v, lo, hi) for k, v in kwargs.items()}

    return num, take


@partial(jax.jit, static_argnames=("spec",))
def _joint_block(spec, mean, draws, block) -> jax.Array:
    """``log (1/K) Σ_k Π_j p(y_j | z_k)`` over the examples of ``block``."""
    def at(z) -> jax.Array:
        return -jnp.sum(jax.vmap(lambda ex: example_loss(spec, z, ex, block.shared))(block.per_example))

    values = jax.lax.map(at, draws, batch_size=64)
    return logsumexp(values) - jnp.log(values.shape[0])


_block_density = by_site_table("pc.lfo")


@_block_density.register(EFSiteTable)
def _ef_block_density(post, block, horizon, num_samples, seed) -> float:
    return ef_block_density(post, block)


@_block_density.register(Sites)
def _gaussian_block_density(post, block, horizon, num_samples, seed) -> float:
    with jax.enable_x64(post.state.mean.dtype == jnp.float64):
        return _gaussian_density(post, block, horizon, num_samples, seed)


_num_points = by_site_table("pc.lfo")


@_num_points.register(EFSiteTable)
def _ef_num_points(post, horizon, num_samples) -> int:
    return ef_num_points(post)


@_num_points.register(Sites)
def _gaussian_num_points(post, horizon, num_samples) -> int:
    if horizon > 1:
        return num_samples
    with jax.enable_x64(post.state.mean.dtype == jnp.float64):
        return rule_nodes(post.rule, post.spec, post.dim, post.state.mean.dtype)[1].shape[0]


def _gaussian_density(post, block, horizon, num_samples, seed) -> float:
    spec = replace(post.spec, num_examples=horizon)
    if horizon == 1:
        value = refit_predictive(post, block, post.state.mean[None], post.state.precision[None])[0]
        return float(value)
    if post.rule.kind == "delta":
        draws = post.state.mean[None]
    else:
        noise = mc_noise(get_rule("mc", num_samples=num_samples, seed=seed), post.dim, post.state.mean.dtype)
        draws = post.family.draws(post.state, noise)
    return float(_joint_block(spec, post.state.mean, draws, block))


def lfo(model, *args, initial, step=1, horizon=1, method="update", num_samples=1000, seed=0, tol=None,
        max_iters=None, fit_options=None, **kwargs) -> Any:
    r"""Leave-future-out ELPD of a time-series model, as an ArviZ ``ELPDData``.

    :param model: the NumPyro model; its data plate runs over time.
    :param args: the model's arguments; arrays whose leading size is the series length
        ``N`` are cut in time, others are passed whole.
    :param int initial: ``L``, the number of examples of the first posterior.
    :param int step: ``s``, examples added between forecast origins (``1``: every origin, the
        exact protocol of Bürkner et al.).
    :param int horizon: ``M``, the number of examples predicted jointly at each origin.
    :param str method: ``"update"`` (streaming exact updates) or ``"refit"`` (``pc.fit``
        at every origin, the brute-force reference).
    :param int num_samples: draws of the joint ``M``-step density (``M > 1``).
    :param float tol: residual tolerance of the fit and of every update (default: the package's).
    :param dict fit_options: options of :func:`numpyro_pc.fit` (``family``, ``expectation`` ...).
    :param kwargs: the model's keyword arguments (cut in time like ``args``).
    :return: a :class:`~numpyro_pc.criticism.loo.LooResult` whose pointwise dimension is
        ``origin`` (``i``, the examples conditioned on); ArviZ knows only LOO and WAIC, so
        the estimate sits under the ``elpd_loo`` label and ``az.compare`` ranks models by it.
        ``p_loo`` is ``Σ_i [log p(y_{i+1:i+M} | y) − log p(y_{i+1:i+M} | y_{1:i})]``.
    """
    if not is_choice(method, METHODS):
        raise InvalidOptionError(f"unknown LFO method {method!r}; expected one of {METHODS}")
    num, take = _slicer(args, kwargs)
    for name, value in dict(initial=initial, step=step, horizon=horizon).items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidOptionError(f"{name} must be a positive integer; got {value!r}")
    if initial + horizon > num:
        raise InvalidOptionError(f"initial ({initial}) + horizon ({horizon}) exceeds the series length {num}")
    fit_options = dict(fit_options or {})
    if tol is not None:
        fit_options["tol"] = tol
    start = time.perf_counter()
    origins = np.arange(initial, num - horizon + 1, step)
    pointwise, blocks = [], []
    post = None
    for k, i in enumerate(origins):
        if method == "refit" or post is None:
            a, kw = take(0, int(i))
            post = fit(model, *a, **fit_options, max_iters=max_iters, **kw)
        else:
            a, kw = take(int(origins[k - 1]), int(i))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # residual notices of near-converged updates
                post = post.update(*a, correction="exact", tol=tol, max_iters=max_iters, **kw)
        a, kw = take(int(i), int(i) + horizon)
        _, block = bind_model(model, a, kw, data_plate=post.spec.plate,
                              allow_discrete=bool(post.spec.latent.discrete_names))
        pointwise.append(_block_density(post, block, horizon, num_samples, seed))
        blocks.append(block)
    # in-sample term for p_loo: every block under the posterior of the whole series
    if method == "update":
        a, kw = take(int(origins[-1]), num)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            full = post.update(*a, correction="exact", tol=tol, max_iters=max_iters, **kw)
    else:
        a, kw = take(0, num)
        full = fit(model, *a, **fit_options, max_iters=max_iters, **kw)
    lppd = [_block_density(full, block, horizon, num_samples, seed) for block in blocks]
    result = elpd_data(pointwise, lppd, None, origins, "origin", _num_points(full, horizon, num_samples),
                       method=f"lfo-{method}")
    result["seconds"] = time.perf_counter() - start
    return result
