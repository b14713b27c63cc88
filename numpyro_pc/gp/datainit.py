"""Scale-free starting values: the kernel, noise and mean initialised from the first batch.

GPJax's defaults (lengthscale 1, variance 1) and the noise default 1 assume standardised data.
On raw data with inputs in thousands or outputs in millionths the first batch's optimiser starts
far from any sensible fit and can settle in the "everything is noise" optimum, where the
lengthscale gradient vanishes. :func:`init_from_data` replaces such values by ones read off the
batch:

* lengthscale ``ℓ_d`` = the median of ``|x_d − x'_d|`` over pairs of batch rows (ARD: one per
  input column of the kernel's ``active_dims``; isotropic: the median of ``‖x − x'‖ / √D``); a
  constant column (median 0) falls back to its standard deviation, then to the median of the
  other columns' values, then to ``max |x_d|``, then to 1; a median or standard deviation at the
  level of rounding (``≤ ROUNDING · max |x_d|``; a constant column's standard deviation is not
  exactly 0) counts as 0;
* kernel variance = the mean squared residual ``mean((y − m(X))²)`` about the (initialised) mean
  function, i.e. ``var(y)`` with a constant mean; a ``SumKernel`` splits it equally among its
  summands, a ``ProductKernel`` gives it to its first factor;
* noise variance = 1/100 of that (a signal-to-noise ratio of 10 in standard deviations: small
  enough that the optimiser starts by explaining the batch with ``f``, large enough to keep the
  first factorisations well conditioned; a noisy data set raises it within the first batch);
* a ``Constant`` mean function's constant = ``mean(y)``.

Only Gaussian regression gets variance, noise and mean: for a non-Gaussian likelihood the latent
scale is set by the link function, not by the units of ``y``, so only lengthscales are
initialised. Kernels other than GPJax's stationary kernels and their sums/products (``Linear``,
``Polynomial``, ``ArcCosine``, ...) and parameters that are not plain ``PositiveReal`` /
``NonNegativeReal`` (e.g. wrapped as non-trainable) are left as written.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["input_scales", "init_from_data", "search_units", "to_search", "from_search", "NOISE_RATIO", "MAX_PAIRS", "ROUNDING"]

NOISE_RATIO = 0.01
MAX_PAIRS = 4096
#: a spread at most ``ROUNDING · max |x_d|`` is rounding error: the column counts as constant
ROUNDING = 64 * float(np.finfo(float).eps)


def _pairs(n, rng) -> tuple[np.ndarray, np.ndarray]:
    if n < 2:
        return np.zeros(0, int), np.zeros(0, int)
    if n * (n - 1) // 2 <= MAX_PAIRS:
        i, j = np.triu_indices(n, 1)
        return i, j
    i = rng.integers(0, n, MAX_PAIRS)
    j = (i + rng.integers(1, n, MAX_PAIRS)) % n
    return i, j


def input_scales(X, rng=None) -> np.ndarray:
    """Per-column typical distance of ``X`` ``(N, D)``: median ``|x_d − x'_d|`` over pairs of rows,
    never zero (see the module docstring for the fall-backs)."""
    X = np.asarray(X, float)
    rng = np.random.default_rng(0) if rng is None else rng
    i, j = _pairs(X.shape[0], rng)
    med = np.median(np.abs(X[i] - X[j]), axis=0) if i.size else np.zeros(X.shape[1])
    std = X.std(0) if X.shape[0] > 1 else np.zeros(X.shape[1])
    # a constant column's std is rounding, not 0 (70 copies of -1.0043510: 4.4e-16): spreads at that level
    # count as zero, else they would become lengthscales and Z's search units
    tiny = ROUNDING * (np.max(np.abs(X), axis=0) if X.shape[0] else np.zeros(X.shape[1]))
    out = np.where(med > tiny, med, np.where(std > tiny, std, 0.0))
    good = out > 0
    for d in np.flatnonzero(~good):
        if good.any():
            out[d] = np.median(out[good])
        else:
            m = np.max(np.abs(X[:, d])) if X.shape[0] else 0.0
            out[d] = m if m > 0 else 1.0
    return out


def _isotropic_scale(X, rng) -> float:
    X = np.asarray(X, float)
    i, j = _pairs(X.shape[0], rng)
    if i.size:
        med = float(np.median(np.linalg.norm(X[i] - X[j], axis=1))) / np.sqrt(X.shape[1])
        if med > 0:
            return med
    return float(np.sqrt(np.mean(input_scales(X, rng) ** 2)))


def _is_default(p, value, force) -> bool:
    """Whether the parameter ``p`` may be replaced: a plain ``PositiveReal``/``NonNegativeReal`` that
    holds GPJax's default ``value`` everywhere, to 1e-6 relative (the softplus round trip turns 1.0 into
    0.99999999955), or anything plain when ``force``."""
    from gpjax.parameters import NonNegativeReal, PositiveReal, val

    if type(p) not in (PositiveReal, NonNegativeReal):
        return False
    return force or bool(np.allclose(np.asarray(val(p)), value, rtol=1e-6, atol=0.0))  # softplus round trip


def _set(module, name, p, value):
    new = type(p)(jnp.asarray(value, jnp.float64))
    return eqx.tree_at(lambda m: getattr(m, name), module, new)


def _kernel(kernel, X, variance, force, rng, path, done, left):
    """Initialise one GPJax kernel (recursively for sums/products); record paths in ``done``/``left``."""
    import gpjax as gpx
    from gpjax.kernels.base import CombinationKernel
    from gpjax.kernels.stationary.base import StationaryKernel
    from gpjax.parameters import val

    if isinstance(kernel, CombinationKernel):
        kernels = list(kernel.kernels)
        is_sum = isinstance(kernel, gpx.kernels.SumKernel)
        new = []
        for k, sub in enumerate(kernels):
            v = None if variance is None else (variance / len(kernels) if is_sum else (variance if k == 0 else None))
            new.append(_kernel(sub, X, v, force, rng, f"{path}.kernels[{k}]", done, left))
        return eqx.tree_at(lambda m: m.kernels, kernel, new)
    if not isinstance(kernel, StationaryKernel):
        left.append(f"{path} ({type(kernel).__name__})")
        return kernel
    Xa = np.asarray(X, float)[:, np.arange(X.shape[1])[kernel.active_dims]]
    white = isinstance(kernel, gpx.kernels.White)
    if not white and _is_default(kernel.lengthscale, 1.0, force):
        ls = np.asarray(val(kernel.lengthscale))
        if ls.ndim == 1 and ls.shape[0] == Xa.shape[1] and ls.shape[0] > 1:
            value = input_scales(Xa, rng)
        else:
            value = np.full(ls.shape, _isotropic_scale(Xa, rng))
        kernel = _set(kernel, "lengthscale", kernel.lengthscale, value)
        done.append(f"{path}.lengthscale")
    if variance is not None and _is_default(kernel.variance, 1.0, force):
        kernel = _set(kernel, "variance", kernel.variance, NOISE_RATIO * variance if white else variance)
        done.append(f"{path}.variance")
    return kernel


def init_from_data(hyper, X, y, obs=None, *, gaussian, force=False, init_noise=True, rng=None) -> tuple[Any, Any, Any]:
    """Starting values of a :class:`~numpyro_pc.gp.state.Hyper` read off one batch.

    :param hyper: the hyperparameters as the user built them.
    :param X: batch inputs ``(N, D)``.
    :param y: batch outputs ``(N,)``.
    :param obs: optional ``(N,)`` booleans, ``False`` where ``y`` is missing (such rows still count for
        the input spread).
    :param bool gaussian: Gaussian likelihood (variance, noise and mean are initialised only then).
    :param bool force: replace every plain parameter, not only those at GPJax's defaults.
    :param bool init_noise: replace the noise variance (the user did not set it).
    :param rng: ``numpy.random.Generator`` for the pair subsample of large batches.
    :return: ``(hyper, initialised, left)``: the new ``Hyper``, the paths set from the data (e.g.
        ``"kernel.lengthscale"``, ``"noise"``, ``"mean_function.constant"``) and the kernels left as
        written.
    """
    import gpjax as gpx

    rng = np.random.default_rng(0) if rng is None else rng
    X = np.asarray(X, float)
    y = np.asarray(y, float).reshape(-1)
    obs = np.ones(y.shape, bool) if obs is None else np.asarray(obs, bool).reshape(-1)
    Xo, y = X[obs], y[obs]
    done: list[Any] = []
    left: list[Any] = []
    variance = None
    if gaussian and y.size:
        mf = hyper.mean_function
        if isinstance(mf, gpx.mean_functions.Constant) and not isinstance(mf.constant, eqx.Module) and (
                force or bool(np.all(np.asarray(mf.constant) == 0.0))):
            c = np.asarray(mf.constant)
            mf = eqx.tree_at(lambda m: m.constant, mf, jnp.full(c.shape, float(np.mean(y)), jnp.float64))
            hyper = eqx.tree_at(lambda h: h.mean_function, hyper, mf)
            done.append("mean_function.constant")
        resid = y - np.asarray(hyper.mean_function(jnp.asarray(Xo))).reshape(-1)
        v = float(np.mean(resid ** 2))
        variance = v if v > 0 and np.isfinite(v) else None
    kernel = _kernel(hyper.kernel, X, variance, force, rng, "kernel", done, left)
    hyper = eqx.tree_at(lambda h: h.kernel, hyper, kernel)
    if gaussian and init_noise and variance is not None and hyper.noise is not None:
        hyper = eqx.tree_at(lambda h: h.noise, hyper, type(hyper.noise)(jnp.asarray(NOISE_RATIO * variance,
                                                                                    jnp.float64)))
        done.append("noise")
    return hyper, done, left


def search_units(hyper, X, y, obs=None, *, gaussian, rng=None) -> Any:
    """The data's own unit of every positive hyperparameter, as a :class:`~numpyro_pc.gp.state.Hyper` of the
    structure of ``hyper``: what :func:`init_from_data` would set with ``force=True`` (lengthscale = input
    spread, kernel variance = ``var(y)``), except the noise, whose unit is ``var(y)`` too; parameters the data
    say nothing about (kernels left as written, non-Gaussian variances) keep their own starting value. Only
    :func:`to_search` reads it; the model's values are not changed."""
    units, _, _ = init_from_data(hyper, X, y, obs, gaussian=gaussian, force=True, init_noise=True, rng=rng)
    if units.noise is not None and units.noise is not hyper.noise:
        from gpjax.parameters import val

        units = eqx.tree_at(lambda h: h.noise, units, type(units.noise)(val(units.noise) / NOISE_RATIO))
    return units


def _positive(x) -> bool:
    from gpjax.parameters import NonNegativeReal, PositiveReal

    return isinstance(x, (PositiveReal, NonNegativeReal))


def _softplus_inv(v) -> jax.Array:
    """``softplus⁻¹(v) = v + log(−expm1(−v))`` for ``v > 0``, stable at both ends (``≈ log v`` for small ``v``)."""
    return v + jnp.log(-jnp.expm1(-v))


def _map_positive(tree, fn, units=None) -> Any:
    def one(x, *unit) -> Any:
        if _positive(x) and eqx.is_inexact_array(x._unconstrained):
            c = None
            if unit and _positive(unit[0]):
                c = jax.nn.softplus(unit[0]._unconstrained)
                c = jnp.where(jnp.isfinite(c) & (c > 0), c, 1.0)
            return eqx.tree_at(lambda p: p._unconstrained, x, fn(x._unconstrained, c))
        return x

    if units is None:
        return jax.tree.map(one, tree, is_leaf=_positive)
    return jax.tree.map(one, tree, units, is_leaf=_positive)


def _map_Z(tree, fn):
    Z = getattr(tree, "Z", None)
    if Z is None or not eqx.is_inexact_array(Z):
        return tree
    return eqx.tree_at(lambda h: h.Z, tree, fn(Z))


def to_search(params, input_scale=None, units=None) -> Any:
    """The optimiser's coordinates of a partitioned :class:`~numpyro_pc.gp.state.Hyper`, ``Z`` divided by
    ``input_scale`` (``(D,)``; ``None``: as is) and every softplus-positive parameter θ
    (``PositiveReal``/``NonNegativeReal``) as

    * ``softplus⁻¹(θ / c)`` with ``c`` its unit in ``units`` (:func:`search_units`, partitioned as ``params``):
      ``≈ log(θ / c)`` below the data's scale, ``≈ θ / c`` above it;
    * ``log θ`` where ``units`` is ``None``.

    Either way multiplying the data by a constant shifts or scales the coordinates without changing the
    optimiser's steps (GPJax's own softplus is the identity above ~20, where a raw step is absolute, so a
    lengthscale of 10⁶ would hardly move). With units, a lengthscale far above the input spread or a variance
    far above ``var(y)`` is far away, as in GPJax's coordinates on standardised data: pure ``log θ`` reaches
    them in a few steps, and there the bound is flat (its gradient in ``log ℓ`` falls as ``ℓ⁻²``), so an ARD
    column switched off on a small first batch stays off for the whole stream (concrete, 10 batches: +0.09
    nats against one batch; docs/gp.md, "Units of the data")."""
    if units is None:
        u = _map_positive(params, lambda r, c: jnp.log(jax.nn.softplus(r)))
    else:
        u = _map_positive(params, lambda r, c: _softplus_inv(jax.nn.softplus(r) / c), units)
    if input_scale is not None:
        u = _map_Z(u, lambda Z: Z / input_scale)
    return u


def from_search(u, input_scale=None, units=None) -> Any:
    """Inverse of :func:`to_search` (the same ``input_scale`` and ``units``)."""
    if units is None:
        p = _map_positive(u, lambda t, c: _softplus_inv(jnp.exp(t)))
    else:
        p = _map_positive(u, lambda t, c: _softplus_inv(c * jax.nn.softplus(t)), units)
    if input_scale is not None:
        p = _map_Z(p, lambda Z: Z * input_scale)
    return p
