"""State of a streaming sparse GP and the linear algebra shared by its bounds.

The state is a :class:`GPState` NamedTuple (a pytree): inducing inputs ``Z``, the
Gaussian ``q(u) = N(mean, cov)`` over ``u = f(Z)``, the prior covariance ``Kzz`` of the
hyperparameters that produced it (jitter already added, see ``jitter``), their Cholesky
factors, and the hyperparameters themselves (a :class:`Hyper` module).

The *hand-over* of Bui, Nguyen & Turner (2017) after a batch is
``Z_a ← Z_b``, ``(m_a, S_a) ← q(b)``, ``K'_aa ← k_θ(Z_b, Z_b) + εI``; the jitter ``ε`` is
recorded in the state and the stored ``Kzz`` already contains it, so no code path adds it
again (:func:`handover`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import NonFiniteResultError, NotPositiveDefiniteError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["Hyper", "GPState", "kernel_matrix", "kernel_diag", "mean_vector", "noise_variance", "chol",
           "check_chol", "inducing_cross", "handover", "predict_from_q", "prior_state", "full_cov", "gaussian_kl",
           "kl_to_previous", "hyperparameters"]


class Hyper(eqx.Module):
    """Everything the bound is optimised over: GPJax kernel and mean function, the
    Gaussian noise variance (``None`` for non-Gaussian likelihoods), the likelihood's own
    parameters, and the new inducing inputs ``Z``.

    The noise variance is stored through GPJax's ``PositiveReal`` (softplus), so every
    inexact array leaf is an unconstrained real and can be optimised directly.
    """

    kernel: eqx.Module
    mean_function: eqx.Module
    noise: Optional[eqx.Module]
    likelihood: Optional[eqx.Module]
    Z: jax.Array


class GPState(NamedTuple):
    """Hand-over state between batches (all arrays float64).

    :ivar Z: inducing inputs ``(M, D)``.
    :ivar mean: mean of ``q(u)``, ``(M,)``.
    :ivar cov: covariance of ``q(u)``, ``(M, M)``.
    :ivar chol_cov: lower Cholesky factor of ``cov`` (checked).
    :ivar Kzz: ``k_θ(Z, Z) + εI`` with the hyperparameters that produced ``q(u)``.
    :ivar chol_Kzz: lower Cholesky factor of ``Kzz`` (checked).
    :ivar jitter: the ``ε`` already contained in ``Kzz``.
    :ivar hyper: the hyperparameters (:class:`Hyper`) that produced ``q(u)``.
    """

    Z: jax.Array
    mean: jax.Array
    cov: jax.Array
    chol_cov: jax.Array
    Kzz: jax.Array
    chol_Kzz: jax.Array
    jitter: jax.Array
    hyper: Hyper


def kernel_matrix(kernel, X, Y) -> jax.Array:
    """Cross-covariance ``k(X, Y)`` of a GPJax kernel as a dense array."""
    return kernel.cross_covariance(X, Y)


def kernel_diag(kernel, X) -> jax.Array:
    """Diagonal ``k(x_n, x_n)`` for every row of ``X``."""
    return jax.vmap(lambda x: kernel(x, x))(X)


def mean_vector(mean_function, X) -> jax.Array:
    """Prior mean at the rows of ``X`` as a vector ``(N,)``."""
    return jnp.reshape(mean_function(X), (X.shape[0],))


def noise_variance(hyper) -> jax.Array:
    """The Gaussian noise variance ``σ²`` of a :class:`Hyper` (GPJax ``val`` unwrapping)."""
    from gpjax.parameters import val

    return val(hyper.noise)


def chol(A) -> jax.Array:
    """Lower Cholesky factor of a symmetric matrix (symmetrised first; no jitter added)."""
    return jnp.linalg.cholesky(0.5 * (A + A.T))


def check_chol(L, what) -> jax.Array:
    """Raise :class:`NotPositiveDefiniteError` if a Cholesky factor is not finite.

    Call outside traced code after every factorisation whose failure must not turn into a
    silent NaN.

    :param L: the factor returned by :func:`chol`.
    :param str what: a name for the error message.
    :return: ``L`` unchanged.
    """
    if not bool(np.all(np.isfinite(np.asarray(L)))):
        raise NotPositiveDefiniteError(f"{what} is not positive definite (Cholesky returned non-finite values); "
                                       "increase the jitter or check the hyperparameters.")
    return L


def handover(hyper, mean, cov, jitter) -> GPState:
    """Build the next batch's old state from a fitted ``q(b)`` (Bui et al. 2017, §3.1).

    :param Hyper hyper: hyperparameters and ``Z_b`` of the batch just fitted.
    :param mean: mean of ``q(b)``.
    :param cov: covariance of ``q(b)``.
    :param float jitter: ``ε`` added once to ``k_θ(Z_b, Z_b)``.
    :return: :class:`GPState`.
    :raises NonFiniteResultError: if ``q(b)`` has non-finite entries.
    :raises NotPositiveDefiniteError: if ``cov`` or ``Kzz`` cannot be factorised.
    """
    if not (np.all(np.isfinite(np.asarray(mean))) and np.all(np.isfinite(np.asarray(cov)))):
        raise NonFiniteResultError("q(b) has non-finite entries after the update; the bound's optimisation "
                                   "diverged (try a larger jitter or fewer optimiser iterations).")
    Z = hyper.Z
    Kzz = kernel_matrix(hyper.kernel, Z, Z) + jitter * jnp.eye(Z.shape[0], dtype=Z.dtype)
    cov = 0.5 * (cov + cov.T)
    return GPState(Z=Z, mean=mean, cov=cov, chol_cov=check_chol(chol(cov), "cov of q(u)"), Kzz=Kzz,
                   chol_Kzz=check_chol(chol(Kzz), "K(Z, Z) + jitter"), jitter=jnp.asarray(jitter, Z.dtype),
                   hyper=hyper)


def prior_state(hyper, jitter) -> GPState:
    """The state before any data: ``q(u) = p(u) = N(0, K_zz + εI)``.

    Used as the "old posterior" of the first batch; every old-posterior term of the
    streaming bounds then cancels exactly (same matrices, same operations), so the first
    batch is Titsias' SGPR (collapsed) or the standard SVGP bound (uncollapsed).
    """
    Z = hyper.Z
    Kzz = kernel_matrix(hyper.kernel, Z, Z) + jitter * jnp.eye(Z.shape[0], dtype=Z.dtype)
    L = check_chol(chol(Kzz), "K(Z, Z) + jitter")
    return GPState(Z=Z, mean=jnp.zeros(Z.shape[0], Z.dtype), cov=Kzz, chol_cov=L, Kzz=Kzz, chol_Kzz=L,
                   jitter=jnp.asarray(jitter, Z.dtype), hyper=hyper)


def predict_from_q(hyper, Z, mean, cov, chol_Kzz, Xs) -> tuple[jax.Array, Any]:
    """Marginals of ``f(x*)`` under ``q(u)`` at ``Z`` with the hyperparameters ``hyper``.

    ``μ* = m(x*) + k_*Z K_ZZ⁻¹ m``, ``σ²* = k** − k_*Z K_ZZ⁻¹ k_Z* + k_*Z K_ZZ⁻¹ S K_ZZ⁻¹ k_Z*``.

    :return: ``(mean, var)`` of shape ``(N*,)``.
    """
    Kzs = kernel_matrix(hyper.kernel, Z, Xs)
    V = jax.scipy.linalg.solve_triangular(chol_Kzz, Kzs, lower=True)
    W = jax.scipy.linalg.cho_solve((chol_Kzz, True), Kzs)
    mu = mean_vector(hyper.mean_function, Xs) + W.T @ mean
    var = kernel_diag(hyper.kernel, Xs) - jnp.sum(V * V, 0) + jnp.sum(W * (cov @ W), 0)
    return mu, var


def inducing_cross(kernel, Zb, Za, jitter) -> jax.Array:
    """``cov(u_b, u_a) = k(Z_b, Z_a) + ε·[z_b = z_a]``: the jitter as white noise on inducing variables.

    Coincident inducing inputs share their jitter noise, so ``Z_b = Z_a`` gives exactly
    ``K_bb + εI`` and the streaming update with unchanged ``Z`` is exact.
    """
    same = jnp.all(Zb[:, None, :] == Za[None, :, :], axis=-1)
    return kernel_matrix(kernel, Zb, Za) + jitter * same.astype(Zb.dtype)


def full_cov(state, Xs) -> jax.Array:
    """Full covariance of ``q(f(Xs))`` under ``state`` (used for projections between inducing sets)."""
    h = state.hyper
    Kzs = kernel_matrix(h.kernel, state.Z, Xs)
    V = jax.scipy.linalg.solve_triangular(state.chol_Kzz, Kzs, lower=True)
    W = jax.scipy.linalg.cho_solve((state.chol_Kzz, True), Kzs)
    return kernel_matrix(h.kernel, Xs, Xs) - V.T @ V + W.T @ state.cov @ W


def gaussian_kl(m1, S1, m0, L0) -> jax.Array:
    """``KL[N(m1, S1) ‖ N(m0, L0 L0ᵀ)]``."""
    from jax.scipy.linalg import cho_solve

    d = m1 - m0
    L1 = chol(S1)
    return 0.5 * (jnp.trace(cho_solve((L0, True), S1)) + d @ cho_solve((L0, True), d) - m1.shape[0]
                  + 2 * jnp.sum(jnp.log(jnp.diag(L0))) - 2 * jnp.sum(jnp.log(jnp.diag(L1))))


def kl_to_previous(new, old) -> jax.Array:
    """``KL[q_new(a) ‖ q_old(a)]`` with ``q_new(a)`` the new posterior's marginal at the old ``Z_a`` (pure)."""
    m_a, _ = predict_from_q(new.hyper, new.Z, new.mean, new.cov, new.chol_Kzz, old.Z)
    S_a = full_cov(new, old.Z)
    return gaussian_kl(m_a, S_a + 1e-10 * jnp.eye(old.Z.shape[0], dtype=S_a.dtype), old.mean, old.chol_cov)


@eqx.filter_jit
def _unwrap(hyper):
    import paramax

    return paramax.unwrap(eqx.tree_at(lambda t: t.Z, hyper, None))


def hyperparameters(hyper) -> dict[str, Any]:
    """Constrained hyperparameter values as ``{path: float or list}`` (``Z`` excluded)."""
    h = _unwrap(hyper)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(h)[0]:
        if eqx.is_inexact_array(leaf):
            key = jax.tree_util.keystr(path).replace(".", "", 1)
            v = np.asarray(leaf)
            out[key] = float(v) if v.ndim == 0 else v.tolist()
    return out
