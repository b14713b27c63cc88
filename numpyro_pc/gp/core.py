r"""Functional core of the streaming sparse GP (Gaussian likelihood, collapsed bound).

Everything a stream carries is one pytree, :class:`StreamingGPState`: ``q(u)``, ``Z``,
``K'_ZZ`` and the hyperparameters (:class:`~numpyro_pc.gp.state.GPState`), the running
noise statistics of ``noise_memory``, the correction memory (:class:`MemoryState`) and a
PRNG key. :func:`step` is a pure function ``(config, state, X, y, mask) → (state, info)``
with static shapes, so a whole stream runs under ``jax.lax.scan``::

    state = init_state(hyper, Z0, config)
    state, infos = jax.lax.scan(lambda s, b: step(config, s, *b), state, (Xs, ys, masks))

:func:`fit_batch` is the part of :func:`step` after the choice of ``Z_b``;
:class:`~numpyro_pc.gp.StreamingSparseGP` is a thin facade that chooses ``Z_b`` with the
host-side policies of :mod:`~numpyro_pc.gp.inducing`, calls :func:`fit_batch` under
``jit`` and checks the result (typed errors) outside traced code. :func:`step` chooses
``Z_b`` in JAX (the ``"keep"`` policy: a random ``keep_fraction`` of the old ``Z`` plus
random rows of the batch). Nothing here raises on non-finite values (it cannot, under
``jit``): ``info["finite"]`` says whether the bound and ``q(u)`` are finite.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from numpyro_pc.deprecation import warn_renamed
from . import bounds, corrected
from .datainit import from_search, to_search
from .optim import minimize
from .state import GPState, chol, kernel_matrix, kl_to_previous, noise_variance, predict_from_q
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["GPStreamConfig", "MemoryState", "StreamingGPState", "init_state", "fit_batch", "step", "keep_inducing",
           "reservoir_update", "noise_memory_term"]

_LOG2PI = 1.8378770664093453


class GPStreamConfig(NamedTuple):
    """Static configuration of a stream (hashable; changing it recompiles).

    :ivar learn_hyperparameters: optimise θ and the noise.
    :ivar learn_inducing: optimise ``Z_b``.
    :ivar noise_memory: add the old rows' σ²-terms (:func:`noise_memory_term`).
    :ivar method: ``"lbfgs"`` or ``"adam"``; ``max_iters``, ``learning_rate``, ``gtol``, ``ftol`` as in
        :func:`~numpyro_pc.gp.optim.minimize`.
    :ivar keep_fraction: share of old ``Z`` kept by :func:`keep_inducing` (used by :func:`step`).
    :ivar jitter: ε added to every ``K_ZZ``.
    :ivar memory_size: capacity of the correction memory (0: Bui's update).
    :ivar alpha: 0 for VFE, α ∈ (0, 1] for Power-EP (then ``memory_size`` and ``noise_memory`` must be off).
    """

    learn_hyperparameters: bool = True
    learn_inducing: bool = True
    noise_memory: bool = True
    method: str = "lbfgs"
    max_iters: int = 200
    learning_rate: float = 0.01
    gtol: float = 1e-6
    ftol: float = 1e-4
    keep_fraction: float = 0.7
    jitter: float = 1e-6
    memory_size: int = 0
    alpha: float = 0.0


class MemoryState(NamedTuple):
    """Fixed-capacity reservoir of past rows: ``X (C, D)``, ``y``, ``mask``, ``ss`` (frozen noise statistic
    ``(y − μ)² + v`` of each row under the posterior fitted to its batch), and ``seen`` (rows streamed)."""

    X: jax.Array
    y: jax.Array
    mask: jax.Array
    ss: jax.Array
    seen: jax.Array


class StreamingGPState(NamedTuple):
    """Everything a stream carries (a pytree of arrays and GPJax modules).

    :ivar gp: :class:`~numpyro_pc.gp.state.GPState` (``q(u)``, ``Z``, ``K'_ZZ``, jitter, hyperparameters).
    :ivar noise_rows: rows absorbed so far (``n_old`` of :func:`noise_memory_term`).
    :ivar noise_ss: ``Σ (y − μ)² + v`` over those rows, each under the posterior fitted to its batch.
    :ivar memory: :class:`MemoryState`.
    :ivar key: PRNG key of the inducing policy and the reservoir.
    :ivar batch: number of batches absorbed.
    """

    gp: GPState
    noise_rows: jax.Array
    noise_ss: jax.Array
    memory: MemoryState
    key: jax.Array
    batch: jax.Array


def noise_memory_term(hyper, stats) -> jax.Array:
    r"""``−½ n_old log 2πσ² − ss_old / (2σ²)``: the old rows' expected log-likelihood as a function of σ².

    In the batch VFE bound ``Σ_n E_q[log N(y_n | f_n, σ²)] = −½ Σ_n [log 2πσ² + ((y_n − μ_n)² + v_n) / σ²]``;
    Bui's online bound keeps it for the current batch only. With ``q(f_n)`` frozen at the
    posterior fitted to each old batch, the old terms reduce to two running sums.

    :param hyper: current hyperparameters (Gaussian noise).
    :param stats: ``(n_old, ss_old)``.
    """
    n_old, ss_old = stats
    s2 = noise_variance(hyper)
    return -0.5 * n_old * (_LOG2PI + jnp.log(s2)) - 0.5 * ss_old / s2


def empty_memory_state(capacity, dim, dtype=jnp.float64) -> MemoryState:
    """An empty :class:`MemoryState`."""
    z = jnp.zeros(capacity, dtype)
    return MemoryState(jnp.zeros((capacity, dim), dtype), z, z, z, jnp.asarray(0, jnp.int32))


def init_state(hyper, Z0, config, key=None) -> StreamingGPState:
    """The state before any data: ``q(u) = p(u)`` at ``Z0``, empty statistics and memory (pure, jit-able:
    a failed Cholesky factor shows as non-finite ``gp.chol_Kzz``)."""
    hyper = eqx.tree_at(lambda h: h.Z, hyper, jnp.asarray(Z0))
    dtype = hyper.Z.dtype
    M = hyper.Z.shape[0]
    prior = _handover(hyper, jnp.zeros(M, dtype), kernel_matrix(hyper.kernel, hyper.Z, hyper.Z)
                      + config.jitter * jnp.eye(M, dtype=dtype), config.jitter)
    return StreamingGPState(gp=prior, noise_rows=jnp.zeros((), dtype),
                            noise_ss=jnp.zeros((), dtype),
                            memory=empty_memory_state(config.memory_size, hyper.Z.shape[1], dtype),
                            key=jax.random.PRNGKey(0) if key is None else key, batch=jnp.asarray(0, jnp.int32))


def _spec(hyper, config):
    spec = jax.tree.map(lambda x: config.learn_hyperparameters and eqx.is_inexact_array(x), hyper)
    return eqx.tree_at(lambda h: h.Z, spec, config.learn_inducing)


def _handover(hyper, mean, cov, jitter) -> GPState:
    Z = hyper.Z
    Kzz = kernel_matrix(hyper.kernel, Z, Z) + jitter * jnp.eye(Z.shape[0], dtype=Z.dtype)
    cov = 0.5 * (cov + cov.T)
    return GPState(Z=Z, mean=mean, cov=cov, chol_cov=chol(cov), Kzz=Kzz, chol_Kzz=chol(Kzz),
                   jitter=jnp.asarray(jitter, Z.dtype), hyper=hyper)


def reservoir_update(memory, X, y, mask, ss, key) -> MemoryState:
    """Reservoir sampling in JAX: after the update every real row streamed so far is in the memory with
    equal probability (rows are taken in order; ``mask = 0`` rows are skipped; ties go to the later row)."""
    C = memory.X.shape[0]
    if C == 0:
        return memory
    valid = mask > 0
    pos = memory.seen + jnp.cumsum(valid.astype(jnp.int32)) - 1         # index of each real row in the stream
    u = jax.random.uniform(key, pos.shape)
    slot = jnp.where(pos < C, pos, jnp.floor(u * (pos + 1)).astype(jnp.int32))
    slot = jnp.where(valid & (slot < C), slot, C)                           # C = dropped
    winner = jnp.full(C + 1, -1, jnp.int32).at[slot].max(jnp.arange(X.shape[0], dtype=jnp.int32))[:C]
    take = winner >= 0
    w = jnp.maximum(winner, 0)
    pick = lambda new, old: jnp.where(take.reshape((-1,) + (1,) * (old.ndim - 1)), new[w], old)  # noqa: E731
    return MemoryState(pick(X, memory.X), pick(y, memory.y), jnp.where(take, 1.0, memory.mask).astype(memory.mask.dtype),
                       pick(ss, memory.ss), memory.seen + jnp.sum(valid).astype(jnp.int32))


def fit_batch(config, state, Z0, X, y, mask, input_scale=None, units=None) -> tuple[StreamingGPState, dict]:
    """Absorb one (padded, masked) batch with initial inducing inputs ``Z0``; pure and traceable.

    Maximises the online bound (Bui's, or the corrected one when ``config.memory_size > 0``)
    plus the noise-memory term over θ, σ² and ``Z_b``, hands over, then updates the noise
    statistics and the memory. The optimiser moves the log of every positive hyperparameter and
    ``Z / input_scale`` (:func:`~numpyro_pc.gp.datainit.to_search`; ``input_scale``: ``None`` or ``(D,)``
    typical input distances, an array so that a new data set does not recompile), so its steps do not
    depend on the units of the data. With ``units`` (a :class:`~numpyro_pc.gp.state.Hyper` of the data's
    unit of each parameter, :func:`~numpyro_pc.gp.datainit.search_units`) it moves ``softplus⁻¹(θ / unit)``
    instead of ``log θ``: log-like below the data's scale, linear above it, where the bound is flat.

    :return: ``(new_state, info)`` with ``info = dict(bound, iterations, finite, residual_ss, kl_to_previous)``;
        ``finite`` holds one flag per checked quantity (bound, ``L_D``, ``q(u)``, its Cholesky factor,
        ``K_ZZ``'s); ``kl_to_previous`` is ``KL[q_new(a) ‖ q_old(a)]`` at the old ``Z_a`` (against the prior for
        the first batch), computed here so that a stream compiles one program.
    """
    old = state.gp
    hyper0 = eqx.tree_at(lambda h: h.Z, old.hyper, Z0)
    params, static = eqx.partition(hyper0, _spec(hyper0, config))
    use_stats = config.noise_memory and config.learn_hyperparameters
    zero = jnp.zeros((), X.dtype)
    stats = (state.noise_rows, state.noise_ss) if use_stats else (zero, zero)
    Xa, ya, ma, sites = X, y, mask, None
    if config.memory_size:              # memory rows enter exactly; their sites leave the old term
        mem = state.memory
        sites = corrected.gaussian_sites(old, mem.X, mem.y, mem.mask)
        Xa, ya, ma = jnp.concatenate([X, mem.X]), jnp.concatenate([y, mem.y]), jnp.concatenate([mask, mem.mask])
        if use_stats:
            stats = (stats[0] - jnp.sum(mem.mask), stats[1] - jnp.sum(mem.ss * mem.mask))
    scale = jnp.maximum(jnp.sum(ma), 1.0)
    terms = bounds.old_terms(old, sites) if config.alpha == 0.0 else None      # loop-invariant: factorised once

    zs = None if input_scale is None else jnp.asarray(input_scale, X.dtype)
    ref = None if units is None else eqx.partition(eqx.tree_at(lambda h: h.Z, units, Z0), _spec(hyper0, config))[0]

    def loss(u) -> tuple[Any, Any]:
        hyper = eqx.combine(from_search(u, zs, ref), static)
        fit = bounds.collapsed_fit(hyper, old, Xa, ya, ma, config.alpha, None, terms)
        return -(fit.bound + noise_memory_term(hyper, stats)) / scale, fit

    iters = evals = jnp.asarray(0)
    fit = None
    if jax.tree.leaves(params):                # q(b) of the final iterate comes with it (no second trace)
        res = minimize(loss, to_search(params, zs, ref), config.method, config.max_iters, config.learning_rate, config.gtol, config.ftol,
                       has_aux=True)
        params, iters, fit = from_search(res.params, zs, ref), res.iterations, res.aux
        evals = iters if res.evaluations is None else res.evaluations
    hyper = eqx.combine(params, static)
    if fit is None:
        fit = bounds.collapsed_fit(hyper, old, Xa, ya, ma, config.alpha, None, terms)
    gp = _handover(hyper, fit.mean, fit.cov, config.jitter)
    mu, var = predict_from_q(gp.hyper, gp.Z, gp.mean, gp.cov, gp.chol_Kzz, X)
    ss = mask * ((y - mu) ** 2 + jnp.maximum(var, 0.0))
    key, k_res = jax.random.split(state.key)
    memory = reservoir_update(state.memory, X, y, mask, ss, k_res)
    finite = dict(bound=jnp.isfinite(fit.bound), chol_D=jnp.all(jnp.isfinite(fit.chol_D)),
                  q=jnp.all(jnp.isfinite(gp.mean)) & jnp.all(jnp.isfinite(gp.cov)),
                  chol_cov=jnp.all(jnp.isfinite(gp.chol_cov)), chol_Kzz=jnp.all(jnp.isfinite(gp.chol_Kzz)))
    new = StreamingGPState(gp=gp, noise_rows=state.noise_rows + jnp.sum(mask), noise_ss=state.noise_ss + jnp.sum(ss),
                           memory=memory, key=key, batch=state.batch + 1)
    return new, dict(bound=fit.bound, iterations=iters, evaluations=evals, finite=finite, residual_ss=ss,
                     kl_to_previous=kl_to_previous(gp, old))


def keep_inducing(key, Z_old, X, mask, keep_fraction) -> jax.Array:
    """Bui's ``"keep"`` policy in JAX: a random ``keep_fraction`` of the old ``Z`` and random real rows of ``X``."""
    M = Z_old.shape[0]
    n_keep = int(round(keep_fraction * M))
    k1, k2 = jax.random.split(key)
    kept = Z_old[jax.random.permutation(k1, M)[:n_keep]]
    g = jax.random.gumbel(k2, mask.shape) + jnp.where(mask > 0, 0.0, -jnp.inf)   # Gumbel top-k: no replacement
    new = X[jnp.argsort(-g)[:M - n_keep]]
    return jnp.concatenate([kept, new])


def step(config, state, X, y, mask) -> tuple[StreamingGPState, dict]:
    """One batch of the stream: ``Z_b`` by :func:`keep_inducing`, then :func:`fit_batch`. Pure; ``lax.scan``-able."""
    key, k_z = jax.random.split(state.key)
    first = state.batch == 0
    Z0 = keep_inducing(k_z, state.gp.Z, X, mask, config.keep_fraction)
    Z0 = jnp.where(first, state.gp.Z, Z0)            # the first batch keeps the initial Z (no old posterior yet)
    return fit_batch(config, state._replace(key=key), Z0, X, y, mask)


def __getattr__(name: str) -> type:
    if name == "StreamConfig":  # renamed: numpyro_pc.kernels.stream_state.StreamConfig is the posterior stream's
        warn_renamed("numpyro_pc.gp.StreamConfig is now GPStreamConfig (StreamConfig is the dual-form stream's, "
                     "numpyro_pc.kernels.stream_state); the old name will be removed in the next release")
        return GPStreamConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
