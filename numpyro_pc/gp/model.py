"""``StreamingSparseGP``: the thin, immutable user-facing class over the functional core.

Each :meth:`StreamingSparseGP.update` (1) initialises ``Z_b`` by the chosen policy, (2)
pads the batch to a bucket (powers of two) with a mask, (3) maximises the online bound
jointly over hyperparameters, noise / likelihood parameters and ``Z_b`` (and ``q(b)`` for
the uncollapsed bound), warm-started from the previous batch, inside one jitted function
whose shapes do not depend on the batch, and (4) hands the state over. All algebra runs
in float64 inside ``jax.enable_x64(True)``; the global setting is left alone.
"""

from __future__ import annotations

import copy
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import (
    DataShapeError,
    InvalidOptionError,
    NonFiniteDataError,
    NonFiniteResultError,
    NotFittedError,
    NotPositiveDefiniteError,
)
from . import core, corrected, datainit, inducing, uncollapsed
from .core import noise_memory_term
from .optim import minimize
from .state import (
    Hyper,
    check_chol,
    chol,
    full_cov,
    gaussian_kl,
    handover,
    hyperparameters,
    kernel_diag,
    kernel_matrix,
    kl_to_previous,
    predict_from_q,
    prior_state,
)
from .usage import plot_gp
from .usage import progress as _progress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import StreamingGPState
    from .state import GPState
    from typing import Any

__all__ = ["StreamingSparseGP", "gp_batch_bucket", "gaussian_kl", "noise_memory_term"]

DEFAULT_MEMORY = 1024


def gp_batch_bucket(n, minimum=16) -> int:
    """Smallest power of two ``≥ max(n, minimum)``: a streaming GP pads its batches to it (the rows of a
    dual-form posterior are bucketed by :func:`numpyro_pc.model.rows.bucket_size`, another rule)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _to64(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) if eqx.is_inexact_array(x) else x, tree)


def _filter(hyper, learn_hyper, learn_Z):
    spec = jax.tree.map(lambda x: learn_hyper and eqx.is_inexact_array(x), hyper)
    return eqx.tree_at(lambda h: h.Z, spec, learn_Z)


_fit_batch = eqx.filter_jit(core.fit_batch)
_init_state = eqx.filter_jit(core.init_state)       # one program instead of a dozen op-by-op compilations


def _zs(input_scale) -> jax.Array | None:
    return None if input_scale is None else jnp.asarray(input_scale, jnp.float64)


def _q_from_raw(raw) -> uncollapsed.WhitenedQ:
    mean, P = raw
    return uncollapsed.WhitenedQ(mean, jnp.tril(P, -1) + jnp.diag(jax.nn.softplus(jnp.diag(P))))


def _q_to_raw(q) -> tuple[Any, jax.Array]:
    d = jnp.diag(q.chol)
    return q.mean, jnp.tril(q.chol, -1) + jnp.diag(jnp.log(jnp.expm1(jnp.maximum(d, 1e-12))))


@eqx.filter_jit
def _uncollapsed_step(params, static, raw_q, old, X, y, mask, mem, sites, method, max_iters, lr, gtol, zs,
                      units) -> tuple[Any, Any, Any, Any, Any]:
    scale = jnp.maximum(jnp.sum(mask), 1.0)

    def objective(u, rq) -> jax.Array:
        hyper = eqx.combine(datainit.from_search(u, zs, units), static)
        q = _q_from_raw(rq)
        value = uncollapsed.uncollapsed_bound(hyper, old, X, y, mask, q)
        if mem is not None:
            Zb = hyper.Z
            Lb = chol(kernel_matrix(hyper.kernel, Zb, Zb) + old.jitter * jnp.eye(Zb.shape[0], dtype=Zb.dtype))
            value = value + corrected.correction_term(hyper, old, Lb, q, mem[0], mem[1], mem[2], sites)
        return value

    res = minimize(lambda pq: -objective(*pq) / scale, (datainit.to_search(params, zs, units), raw_q), method, max_iters,
                   lr, gtol)
    u, rq = res.params
    return datainit.from_search(u, zs, units), rq, objective(u, rq), res.iterations, res.evaluations


class StreamingSparseGP:
    """Streaming sparse GP (Bui, Nguyen & Turner 2017) with learned θ, noise and ``Z``.

    :param kernel: any GPJax kernel (ARD lengthscales included).
    :param int num_inducing: ``M``, fixed over the stream.
    :param likelihood: ``None`` or ``gpx.likelihoods.Gaussian`` for regression (collapsed
        bound), or a non-Gaussian GPJax likelihood (``Bernoulli``, ``Poisson``,
        :class:`~numpyro_pc.gp.uncollapsed.BernoulliLogit`): uncollapsed bound.
    :param mean_function: a GPJax mean function (default ``Zero``).
    :param float noise_variance: initial ``σ²`` (Gaussian likelihood; a ``Gaussian``
        likelihood passed in overrides it with its ``obs_stddev²``). ``None`` (default): not set, i.e.
        initialised from the data (see ``init_from_data``), else 1.
    :param float alpha: 0 for VFE, α ∈ (0, 1] for Power-EP (collapsed only).
    :param str bound: ``"collapsed"`` or ``"uncollapsed"`` (default: collapsed for Gaussian).
    :param str inducing: initialisation policy per batch, see :mod:`numpyro_pc.gp.inducing`.
    :param float keep_fraction: share of old ``Z`` kept by the ``"keep"`` policy.
    :param Z_init: optional first-batch inducing inputs ``(M, D)``.
    :param bool learn_hyperparameters: optimise θ, noise and likelihood parameters.
    :param bool learn_inducing: optimise ``Z_b`` (forced off by ``inducing="fixed"``).
    :param str optimizer: ``"lbfgs"`` (default) or ``"adam"``.
    :param int max_iters: optimiser iterations per batch (a cap; L-BFGS stops earlier on ``ftol``/``gtol``).
    :param float learning_rate: Adam step size.
    :param float jitter: ε added once to every ``K_ZZ``, recorded in the state. When the kernel variance is
        initialised from the data, ε is relative to it (``jitter × k(x, x)`` at the start; :attr:`jitter` of
        the updated model and ``state.jitter`` hold the absolute value).
    :param int memory_size: > 0 enables the posterior-corrected variant
        (:mod:`numpyro_pc.gp.corrected`) with a memory of that many past examples
        (reservoir sample of the stream). Gaussian likelihood: the memory rows enter the
        collapsed bound through their exact likelihood and their sites leave the old term,
        which keeps θ, noise and ``Z`` informed by old data (no loss as batches accumulate).
        ``None`` (default): 1,024 for the collapsed VFE bound when θ or ``Z`` can change, else
        0; ``0`` is Bui et al.'s original update.
    :param float ftol: L-BFGS stops when the last 10 iterations lowered the per-row objective (the
        negative bound divided by the rows in it) by less than ``ftol · max(1, |objective|)`` each on
        average; ``0`` runs to ``gtol`` or ``max_iters``. The default 1e-4 stops every batch of the
        UCI benchmarks on this criterion; ``1e-5`` gains up to ~0.01 nats of test NLPD on a 1-batch
        fit for 2–5× the iterations (docs/gp.md, "Stopping").
    :param int seed: seed of the inducing policy and memory sampling.
    :param bool noise_memory: learn the Gaussian noise variance from every batch seen, not
        from the current batch alone: the old batches' expected log-likelihood, which is
        all of their σ²-dependence in the batch VFE bound, is carried as two running sums
        (:func:`~numpyro_pc.gp.model.noise_memory_term`) and added to the objective.
        ``None`` (default) turns it on for the collapsed VFE bound (Gaussian likelihood,
        α = 0) and off otherwise; other bounds raise ``ValueError`` if it is asked for;
        ``False`` is Bui et al.'s original update. Only active while hyperparameters are
        learned; the bound recorded in :attr:`history` is always the online bound alone.
    :param init_from_data: scale-free starting values from the first batch
        (:func:`~numpyro_pc.gp.datainit.init_from_data`): lengthscale ``ℓ_d`` = median ``|x_d − x'_d|`` over
        pairs of rows (one per column for an ARD kernel, a constant column falls back to a non-zero value),
        kernel variance = ``var(y)`` (mean square about the mean function), noise = ``var(y)/100``, a
        ``Constant`` mean's constant = ``mean(y)``; sums split the variance among their summands, products
        give it to their first factor; non-stationary kernels are left as written; for a non-Gaussian
        likelihood only lengthscales are set. GPJax cannot tell ``RBF()`` from ``RBF(lengthscale=1.0)``,
        so the rule is by value: ``None`` (default) initialises, when hyperparameters are learned, every
        kernel parameter equal to GPJax's default (lengthscale 1, variance 1), a ``Constant`` mean at 0
        and a ``noise_variance`` left at ``None`` (or a ``Gaussian`` likelihood with ``obs_stddev = 1``);
        ``True`` initialises all of them whatever their values; ``False`` never. What was initialised is
        in :attr:`initialised_from_data`, ``history[0]["initialised_from_data"]`` (kernels left as
        written: ``"left_as_written"``) and the starting values in ``history[i]["initial_hyperparameters"]``.
        Independently of this option the optimiser moves every positive hyperparameter θ as
        ``softplus⁻¹(θ / unit)``, the unit read off the first batch (input spread for lengthscales, ``var(y)``
        for variances and noise; :func:`~numpyro_pc.gp.datainit.search_units`), and ``Z`` in units of the
        input spread, so results do not depend on the units of ``X`` or ``y`` (docs/gp.md, "Units of the
        data"); log-like below the unit, linear above it, so no lengthscale escapes to where the bound is flat.
    """

    def __init__(self, kernel, num_inducing, likelihood=None, mean_function=None, noise_variance=None, alpha=0.0,
                 bound=None, inducing="keep", keep_fraction=0.7, Z_init=None, learn_hyperparameters=True,
                 learn_inducing=True, optimizer="lbfgs", max_iters=200, learning_rate=0.01, gtol=1e-6,
                 jitter=1e-6, memory_size=None, seed=0, noise_memory=None, ftol=1e-4, init_from_data=None):
        import gpjax as gpx
        from gpjax.parameters import PositiveReal

        if not isinstance(num_inducing, int) or num_inducing < 1:
            raise InvalidOptionError(f"num_inducing must be a positive int, got {num_inducing!r}")
        gaussian = likelihood is None or isinstance(likelihood, gpx.likelihoods.Gaussian)
        bound = bound or ("collapsed" if gaussian else "uncollapsed")
        if bound not in ("collapsed", "uncollapsed"):
            raise InvalidOptionError(f"bound must be 'collapsed' or 'uncollapsed', got {bound!r}")
        if bound == "collapsed" and not gaussian:
            raise InvalidOptionError(f"the collapsed bound needs a Gaussian likelihood, got {type(likelihood).__name__}")
        if not 0.0 <= alpha <= 1.0:
            raise InvalidOptionError(f"alpha must be in [0, 1] (0 = VFE), got {alpha}")
        if alpha > 0 and bound != "collapsed":
            raise InvalidOptionError("Power-EP (alpha > 0) is implemented for the collapsed (Gaussian) bound only")
        vfe = bound == "collapsed" and alpha == 0.0
        if memory_size is None:
            memory_size = DEFAULT_MEMORY if vfe and (learn_hyperparameters or inducing != "fixed") else 0
        if memory_size and bound == "collapsed" and not vfe:
            raise InvalidOptionError("the corrected collapsed update (memory_size > 0) needs the VFE bound (alpha = 0)")
        if noise_memory is None:
            noise_memory = vfe
        if noise_memory and not vfe:
            raise InvalidOptionError("noise_memory needs the collapsed VFE bound (Gaussian likelihood, alpha = 0)")
        if init_from_data not in (None, True, False):
            raise InvalidOptionError(f"init_from_data must be None, True or False, got {init_from_data!r}")
        noise_set = noise_variance is not None
        if isinstance(likelihood, gpx.likelihoods.Gaussian):
            from gpjax.parameters import val
            noise_variance = float(val(likelihood.obs_stddev)) ** 2
            noise_set = noise_variance != 1.0
        noise_variance = 1.0 if noise_variance is None else noise_variance
        with jax.enable_x64(True):
            self._hyper = Hyper(kernel=_to64(kernel),
                                mean_function=_to64(mean_function or gpx.mean_functions.Zero()),
                                noise=PositiveReal(jnp.asarray(noise_variance, jnp.float64)) if gaussian else None,
                                likelihood=None if gaussian else _to64(likelihood),
                                Z=jnp.zeros((num_inducing, 1)))
        self.num_inducing = num_inducing
        self.alpha = float(alpha)
        self.bound = bound
        self.inducing = inducing
        self.keep_fraction = keep_fraction
        self.Z_init = None if Z_init is None else np.asarray(Z_init, float)
        self.learn_hyperparameters = learn_hyperparameters
        self.learn_inducing = learn_inducing and inducing != "fixed"
        self.optimizer, self.max_iters, self.learning_rate, self.gtol = optimizer, max_iters, learning_rate, gtol
        self.ftol = ftol
        self.jitter = jitter
        self.memory_size = memory_size
        self.noise_memory = bool(noise_memory)
        self.seed = seed
        self.init_from_data = init_from_data
        self._noise_set = noise_set
        self.initialised_from_data = ()
        self._input_scale = None
        self._units = None
        self._rng = np.random.default_rng(seed)
        self._state = None
        self._stream = None
        self._memory = None
        self.history = []

    # ------------------------------------------------------------------ properties
    @property
    def state(self) -> GPState | None:
        """The current :class:`~numpyro_pc.gp.state.GPState` (``None`` before the first batch)."""
        return self._state

    @property
    def stream_state(self) -> StreamingGPState | None:
        """The full :class:`~numpyro_pc.gp.core.StreamingGPState` (collapsed bound; ``None`` otherwise or
        before the first batch): ``q(u)``, ``Z``, hyperparameters, noise statistics, memory, PRNG key."""
        return self._stream

    @property
    def hyper(self) -> Hyper:
        """Current hyperparameters (:class:`~numpyro_pc.gp.state.Hyper`)."""
        return self._state.hyper if self._state is not None else self._hyper

    # ------------------------------------------------------------------ update
    def _check(self, X, y, mask=None) -> tuple[Any, np.ndarray, Any]:
        X = np.asarray(X, float)
        y = np.asarray(y, float).reshape(-1)
        obs = np.ones(y.shape, bool) if mask is None else np.asarray(mask, bool).reshape(-1)
        if obs.shape != y.shape:
            raise DataShapeError(f"mask must have the shape of y {y.shape}, got {obs.shape}")
        if X.ndim == 1:
            X = X[:, None]
        if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise DataShapeError(f"expected X of shape (N, D) and y of shape (N,) with N ≥ 1, got {X.shape} "
                                 f"and {y.shape}")
        if self._state is not None and X.shape[1] != self._state.Z.shape[1]:
            raise DataShapeError(f"X has {X.shape[1]} columns, the stream has {self._state.Z.shape[1]}")
        if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y[obs]))):
            raise NonFiniteDataError("X or the observed y contain NaN or infinite values")
        if not obs.any():
            raise DataShapeError("the batch has no observed output (mask is all False)")
        return X, np.where(obs, y, 0.0), obs

    def _config(self) -> core.GPStreamConfig:
        return core.GPStreamConfig(learn_hyperparameters=self.learn_hyperparameters, learn_inducing=self.learn_inducing,
                                 noise_memory=self.noise_memory, method=self.optimizer, max_iters=self.max_iters,
                                 learning_rate=self.learning_rate, gtol=self.gtol, ftol=self.ftol,
                                 keep_fraction=self.keep_fraction, jitter=self.jitter, memory_size=self.memory_size,
                                 alpha=self.alpha)

    def update(self, X, y, mask=None) -> StreamingSparseGP:
        """Absorb one batch; returns a new :class:`StreamingSparseGP` (``self`` is unchanged).

        :param X: inputs ``(N, D)``.
        :param y: targets ``(N,)`` (0/1 for Bernoulli, counts for Poisson).
        :param mask: optional ``(N,)`` booleans, ``False`` where the output is missing (its ``y`` may be
            NaN); such rows contribute nothing to the bound, the noise statistics or the memory.
        :return: the updated model.
        """
        X, y, obs = self._check(X, y, mask)
        new = copy.copy(self)
        new._rng = copy.deepcopy(self._rng)
        new.history = list(self.history)
        t0 = time.perf_counter()
        with jax.enable_x64(True):
            initialised, left = [], []
            if self._state is None:
                if self.init_from_data or (self.init_from_data is None and self.learn_hyperparameters):
                    new._hyper, initialised, left = datainit.init_from_data(
                        self._hyper, X, y, obs, gaussian=self._hyper.noise is not None,
                        force=self.init_from_data is True, init_noise=self.init_from_data is True or not self._noise_set,
                        rng=np.random.default_rng(self.seed))
                    new.initialised_from_data = tuple(initialised)
                    if any(p.endswith("variance") for p in initialised):     # ε relative to the prior variance
                        new.jitter = self.jitter * max(float(np.mean(np.asarray(kernel_diag(new._hyper.kernel,
                                                                                             jnp.asarray(X[:1]))))),
                                                       np.finfo(float).tiny)
                new._input_scale = tuple(float(v) for v in datainit.input_scales(X, np.random.default_rng(self.seed)))
                new._units = datainit.search_units(new._hyper, X, y, obs, gaussian=self._hyper.noise is not None,
                                                   rng=np.random.default_rng(self.seed))
                Z0 = self.Z_init if self.Z_init is not None else inducing.initial_inducing(
                    X, self.num_inducing, new._rng, self.inducing)
                if Z0.shape != (self.num_inducing, X.shape[1]):
                    raise DataShapeError(f"Z_init must have shape {(self.num_inducing, X.shape[1])}, got {Z0.shape}")
                hyper0 = eqx.tree_at(lambda h: h.Z, new._hyper, jnp.asarray(Z0))
                old = prior_state(hyper0, new.jitter) if self.bound != "collapsed" else None
            else:
                old = self._state
                Z0 = inducing.next_inducing(np.asarray(old.Z), X, new._rng, self.inducing, self.keep_fraction)
                hyper0 = eqx.tree_at(lambda h: h.Z, old.hyper, jnp.asarray(Z0))
            n = X.shape[0]
            nb = gp_batch_bucket(n)
            Xp = np.concatenate([X, np.repeat(X[:1], nb - n, 0)])
            yp = np.concatenate([np.where(obs, y, 0.0), np.zeros(nb - n)])
            mask = np.concatenate([obs.astype(float), np.zeros(nb - n)])
            Xp, yp, mask = jnp.asarray(Xp), jnp.asarray(yp), jnp.asarray(mask)
            if self.bound == "collapsed":
                cfg = new._config()
                stream = self._stream
                if stream is None:
                    stream = _init_state(new._hyper, jnp.asarray(Z0), cfg, jax.random.PRNGKey(self.seed))
                    check_chol(stream.gp.chol_Kzz, "K(Z, Z) + jitter")
                stream, info = _fit_batch(cfg, stream, jnp.asarray(Z0), Xp, yp, mask, _zs(new._input_scale), new._units)
                _check_finite(info["finite"], len(self.history))
                new._stream = stream
                new._state = stream.gp
                value, iters, hyper = info["bound"], info["iterations"], stream.gp.hyper
                evals = info["evaluations"]
                kl_step = info["kl_to_previous"]
            else:
                spec = _filter(hyper0, self.learn_hyperparameters, self.learn_inducing)
                params, static = eqx.partition(hyper0, spec)
                units = None if new._units is None else eqx.partition(eqx.tree_at(lambda h: h.Z, new._units,
                                                                                  hyper0.Z), spec)[0]
                Lb0 = check_chol(chol(kernel_matrix(hyper0.kernel, hyper0.Z, hyper0.Z)
                                      + new.jitter * jnp.eye(self.num_inducing)), "K(Z_b, Z_b) + jitter")
                m0, _ = predict_from_q(old.hyper, old.Z, old.mean, old.cov, old.chol_Kzz, hyper0.Z)
                S0 = full_cov(old, hyper0.Z)
                q0 = uncollapsed.whiten(Lb0, m0, S0 + 1e-10 * jnp.eye(self.num_inducing))
                mem, sites = None, None
                if self.memory_size:
                    memory = new._memory if new._memory is not None else corrected.empty_memory(
                        self.memory_size, X.shape[1])
                    mem = tuple(jnp.asarray(a) for a in memory[:3])
                    sites = corrected.memory_sites(old, mem[0], mem[1]) if self._state is not None else \
                        corrected.empty_sites(self.num_inducing, self.memory_size)
                    mem = mem if self._state is not None else (mem[0], mem[1], jnp.zeros(self.memory_size))
                p, rq, value, iters, evals = _uncollapsed_step(params, static, _q_to_raw(q0), old, Xp, yp, mask, mem, sites,
                                                        self.optimizer, self.max_iters, self.learning_rate, self.gtol,
                                                        _zs(new._input_scale), units)
                hyper = eqx.combine(p, static)
                Zb = hyper.Z
                Lb = check_chol(chol(kernel_matrix(hyper.kernel, Zb, Zb) + new.jitter * jnp.eye(self.num_inducing)),
                                "K(Z_b, Z_b) + jitter")
                mean, cov = uncollapsed.unwhiten(Lb, _q_from_raw(rq))
                if self.memory_size:
                    new._memory = corrected.update_memory(
                        new._memory if new._memory is not None else corrected.empty_memory(self.memory_size,
                                                                                           X.shape[1]),
                        X[obs], y[obs], new._rng)
                if not np.isfinite(float(value)):
                    raise NonFiniteResultError(f"the online bound is not finite after batch {len(self.history)}")
                new._state = handover(hyper, mean, cov, new.jitter)
                kl_step = _kl_to_previous(new._state, old)
            kl_step = None if self._state is None else float(kl_step)
            jax.block_until_ready(new._state.mean)
            new.history.append(dict(batch=len(self.history), n=n, bucket=nb, bound=float(value),
                                    iterations=int(iters), evaluations=int(iters if evals is None else evals),
                                    seconds=time.perf_counter() - t0, kl_to_previous=kl_step,
                                    hyperparameters=hyperparameters(hyper),
                                    initial_hyperparameters=hyperparameters(hyper0), initialised_from_data=initialised,
                                    left_as_written=left))
        return new

    # ------------------------------------------------------------------ prediction
    def predict(self, Xs) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the latent ``f`` at ``Xs`` (``(N*, D)``)."""
        if self._state is None:
            raise NotFittedError("predict needs at least one update() first")
        Xs = self._test_inputs(Xs)
        with jax.enable_x64(True):
            s = self._state
            mu, var = predict_from_q(s.hyper, s.Z, s.mean, s.cov, s.chol_Kzz, jnp.asarray(Xs, float))
            return np.asarray(mu), np.maximum(np.asarray(var), 0.0)

    def _test_inputs(self, Xs) -> np.ndarray:
        """``Xs`` as a finite ``(N*, D)`` float array with the stream's ``D`` (a 1-D array is one column
        when ``D = 1``, else one point), or a typed refusal."""
        try:
            Xs = np.asarray(Xs, float)
        except (TypeError, ValueError):
            raise DataShapeError(f"test inputs must be a numeric array; got {type(Xs).__name__}") from None
        dim = int(self._state.Z.shape[1])
        if Xs.ndim == 1:
            Xs = Xs[:, None] if dim == 1 else Xs[None, :]
        if Xs.ndim != 2 or Xs.shape[1] != dim:
            raise DataShapeError(f"test inputs must have shape (N*, {dim}) like the stream's inputs; got {Xs.shape}")
        bad = ~np.all(np.isfinite(Xs), axis=1)
        if bad.any():
            raise NonFiniteDataError(f"{int(bad.sum())} test input(s) hold NaN or infinite values (first at row "
                                     f"{int(np.flatnonzero(bad)[0])}): a prediction there would be NaN")
        return Xs

    def predict_y(self, Xs) -> tuple[np.ndarray, np.ndarray]:
        """Predictive mean and variance of ``y`` (noise added; class-1 probability for Bernoulli)."""
        mu, var = self.predict(Xs)
        with jax.enable_x64(True):
            m, v = uncollapsed.predict_y(self._state.hyper, jnp.asarray(mu), jnp.asarray(var))
            return np.asarray(m), np.asarray(v)

    def fit_stream(self, batches, progress=None) -> StreamingSparseGP:
        """Absorb an iterable of batches ``(X, y)`` or ``(X, y, mask)``, with a progress bar on a terminal.

        :param batches: iterable of tuples (a list, a generator, ``zip(Xs, ys)``...).
        :param progress: ``True``/``False`` to force the ``tqdm`` bar; ``None``: on a terminal outside CI
            (:func:`~numpyro_pc.gp.usage.use_progress`).
        :return: the model after the last batch.
        """
        sgp = self
        total = len(batches) if hasattr(batches, "__len__") else None
        bar = _progress(batches, total=total, enabled=progress)
        for batch in bar:
            sgp = sgp.update(*batch)
            if hasattr(bar, "set_postfix"):
                h = sgp.history[-1]
                bar.set_postfix(bound=f"{h['bound']:.1f}", its=h["iterations"])
        return sgp

    def plot(self, X=None, y=None, ax=None, **kwargs) -> Any:
        """Predictive band (1-D) or mean (2-D), inducing inputs and the batch ``(X, y)``
        (:func:`~numpyro_pc.gp.usage.plot_gp`); returns the Matplotlib axes."""
        return plot_gp(self, X, y, ax=ax, **kwargs)

    def summary(self) -> dict[Any, Any]:
        """Plain-dict diagnostics: bound per batch, KL between consecutive ``q(u)``, hyperparameter trajectory,
        L-BFGS iterations and seconds per batch, and the running noise statistics of ``noise_memory`` (rows seen,
        sum of expected squared residuals; collapsed bound)."""
        return dict(bound=[h["bound"] for h in self.history],
                    kl_to_previous=[h["kl_to_previous"] for h in self.history],
                    hyperparameters=[h["hyperparameters"] for h in self.history],
                    iterations=[h["iterations"] for h in self.history],
                    seconds=[h["seconds"] for h in self.history],
                    num_inducing=self.num_inducing, alpha=self.alpha, bound_type=self.bound,
                    jitter=self.jitter, noise_memory=self.noise_memory,
                    memory_size=self.memory_size, noise_statistics=dict(
                        rows=float(self._stream.noise_rows) if self._stream is not None else 0.0,
                        sum_sq=float(self._stream.noise_ss) if self._stream is not None else 0.0))


def _check_finite(flags, batch) -> None:
    """Typed errors for the flags of :func:`~numpyro_pc.gp.core.fit_batch` (outside traced code)."""
    flags = {k: bool(v) for k, v in flags.items()}
    if not flags["bound"]:
        raise NonFiniteResultError(f"the online bound is not finite after batch {batch}")
    if not flags["chol_D"]:
        raise NotPositiveDefiniteError("the collapsed bound's D matrix is not positive definite (Cholesky returned "
                                       "non-finite values); increase the jitter or check the hyperparameters.")
    if not flags["q"]:
        raise NonFiniteResultError("q(b) has non-finite entries after the update; the bound's optimisation "
                                   "diverged (try a larger jitter or fewer optimiser iterations).")
    if not (flags["chol_cov"] and flags["chol_Kzz"]):
        raise NotPositiveDefiniteError("cov of q(u) or K(Z, Z) + jitter is not positive definite; increase the jitter.")


_kl_to_previous = eqx.filter_jit(kl_to_previous)
