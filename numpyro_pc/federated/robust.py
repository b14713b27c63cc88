r"""What the server does not take on trust: message validation and bounded aggregation.

**Validation** (:func:`validate_site`, host side, before anything is stored). A client's
message must have the expected number of arrays, the exact shapes and floating dtype of
the run, finite values below a size bound, and — for the full and diagonal families — a
positive semi-definite site precision (up to a relative tolerance). A message that fails
raises :class:`~numpyro_pc.errors.ClientMessageError` naming the client; the server then
leaves that client's stored site unchanged and excludes it from the round.

**Bounded aggregation** (:func:`aggregate_sites`, traced, ``lax.map`` over clients, ``vmap`` over their
references). A client is measured against ``K`` references: for each client ``j`` the posterior ``R_{k,j}`` of
the prior and every site except ``k``'s and ``j``'s (``j = k``: the others' posterior ``P_{-k}, m_{-k}``),
each site's precision taken by its positive semi-definite part ``S^+``. Its site ``(h_k, S_k)`` is kept as
sent if

.. math::
    \lambda_{\max}(P_{-k}^{-1} S_k^+) \le \gamma \quad\text{and}\quad
    \min_j \|h_k - S_k^+ m_{k,j}\|_{P_{k,j}^{-1}} \le c,

and is otherwise replaced by

.. math::
    S_k' = s_k S_k^+, \quad s_k = \min\bigl(1, \gamma / \lambda_{\max}(P_{-k}^{-1} S_k^+)\bigr), \qquad
    h_k' = S_k' m_{k,j^*} + c_k\, g_k, \quad g_k = s_k (h_k - S_k^+ m_{k,j^*}),

with ``j*`` the reference nearest the site and ``c_k = min(1, c / ‖g_k‖_{P_{k,j*}^{-1}})``.

**Guarantee against one rogue client.** Let ``r`` send any finite message and let every other
("honest") client ``i`` have a positive semi-definite site within the bounds against the posterior
``P_{H\i}, m_{H\i}`` of the prior and the other honest sites: ``S_i ⪯ γ P_{H\i}`` and
``‖h_i − S_i m_{H\i}‖_{P_{H\i}^{-1}} ≤ c``. With ``P_H, m_H`` the honest posterior (prior and honest sites),

1. **no honest site is clipped**: the rogue's site only raises ``P_{-i}`` (its positive part counts), and
   the reference without ``i`` and ``r`` is ``(P_{H\i}, m_{H\i})``;
2. ``P_H ⪯ P ⪯ (1 + γ) P_H``: the rogue sharpens the posterior by at most ``1 + γ`` in any direction;
3. .. math:: \|m - m_H\|_{P_H} \le c \Bigl(1 + \frac{\gamma}{1 + \gamma}\Bigr) = c\,\frac{1 + 2\gamma}{1 + \gamma},

   the mean moves by at most that many standard deviations of the honest posterior (``3`` for ``γ = 1,
   c = 2``). Proof: the rogue's references are ``H`` and ``H \ i``, all honest, with ``P_{k,j^*} ⪯ P_H``;
   ``m − m_H = (P_H + S')^{-1}(S'(m_{j^*} − m_H) + c_r g_r)``; with ``A = P_H^{-1/2} S' P_H^{-1/2}``,
   ``0 ⪯ A ⪯ γ``, the first term is at most ``γ/(1+γ) ‖m_{H\i} − m_H‖_{P_H} ≤ γ c/(1+γ)`` (honest ``i``
   within its bound: ``m_H − m_{H\i} = P_H^{-1} g_i``) and the second at most ``‖g_r‖_{P_{k,j^*}^{-1}} ≤ c``.

The statement is about one aggregation and the honest sites as the server holds them; over a run the
honest clients answer the poisoned posterior, and a non-conjugate model's sites move with it (measured
in ``docs/federated.md``). The rogue is held to ``c`` itself (``‖m − m_H‖_{P_H} ≤ c``) when its nearest reference is the honest
posterior; the extra ``γ c/(1+γ)`` is what it can gain by posing as a copy of the honest data without one
client (a near-replay). Without a rogue the same statement holds for each client ``k`` against the others.
An honest client beyond the bounds against the other honest clients is clipped too (the rogue may then
decide which reference is nearest), and the fixed point is no longer the joint posterior
(``benchmarks/RESULTS.md`` measures the cost), so the option is off by default. A site that is kept is
summed exactly as sent, so a run whose bounds no client reaches is the unbounded run bit for bit; a
clipped site loses the negative part of its precision. Items 2 and 3 are stated for a positive
semi-definite rogue precision: the server accepts eigenvalues down to ``−10⁻⁶ λ_max``, which an
unclipped site keeps. The isotropic family's global step ignores the sites' precisions, and so do the
bounds: every reference has the prior's ``τ I``, the test is ``‖h_k‖ ≤ c √τ``, independent of the other
clients, and item 3 holds with ``c`` (in the sds of ``τ I``, the family's global precision). Low-rank sites are refused (their sum is
projected, so the bounds have no meaning there). Cost: ``O(K² d³)`` per aggregation (``K`` Cholesky
factors per client). Measured by ``benchmarks/bench_federated_rogue.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular

from numpyro_pc.families.registry import Gaussian, GaussianNatural
from numpyro_pc.protocols.capabilities import FixedPrecision, SiteSum, capability, require

from ..errors import ClientMessageError, InvalidOptionError
from .core import relative_top

BOUNDS_NEED_SUM = ("The bounds are stated for the global precision P_0 + Σ_k S_k, which needs the sites' sum; use "
                   "family='full', 'diagonal' or 'isotropic'.")

__all__ = ["aggregate_sites", "leave_one_out", "site_shapes", "validate_site", "robust_bounds", "check_bounds"]


def robust_bounds(max_share=None, max_shift=None, dtype=float) -> tuple[jax.Array, jax.Array] | None:
    """The ``(γ, c)`` pair of :func:`aggregate_sites` (``None``: no bounds at all)."""
    if max_share is None and max_shift is None:
        return None
    share, shift = check_bounds(max_share, max_shift)
    return jnp.asarray(share, dtype), jnp.asarray(shift, dtype)


def check_bounds(max_share=None, max_shift=None) -> tuple[float, float]:
    """The bounds of bounded aggregation as floats (``inf``: unbounded), each ``None`` or positive.

    :raises InvalidOptionError: a bound that is not a positive number (NaN, a string, ``True`` included).
    """
    def number(value) -> float:
        if value is None:
            return np.inf
        try:
            if isinstance(value, (bool, str, bytes)):
                raise TypeError
            return float(value)
        except (TypeError, ValueError):
            return np.nan  # refused below, with the message of every other bad bound

    share, shift = number(max_share), number(max_shift)
    if not (share > 0 and shift > 0):
        raise InvalidOptionError(f"max_share and max_shift must be positive, got {max_share}, {max_shift}")
    return share, shift


def _dense(family, mean, precision) -> jax.Array:
    return family.dense_precision(Gaussian(mean, precision))


def leave_one_out(x) -> jax.Array:
    """``Σ_{j≠k} x_j`` for every ``k`` (axis 0), from exclusive prefix and suffix sums."""
    zero = jnp.zeros_like(x[:1])
    before = jnp.concatenate([zero, jnp.cumsum(x, 0)[:-1]])
    after = jnp.concatenate([jnp.cumsum(x[::-1], 0)[:-1][::-1], zero])
    return before + after


def _psd_part(precision) -> jax.Array:
    """One site's precision, in the family's format, with its negative eigenvalues set to 0 (a dense matrix
    through its eigen-decomposition, a vector or scalar element-wise)."""
    if precision.ndim == 2:
        w, v = jnp.linalg.eigh(0.5 * (precision + precision.T))
        return (v * jnp.maximum(w, 0.0)) @ v.T
    return jnp.maximum(precision, 0.0)


def aggregate_sites(family, prior_nat, eta, bounds) -> tuple[GaussianNatural, jax.Array]:
    """Sum of the client sites ``η`` (stacked on axis 0), each bounded as in the module docstring.

    Client ``k`` is measured against ``K`` references: the others' posterior ``R_{-k}`` and, for each other
    client ``j``, the posterior without ``k`` and ``j``; its shift is the smallest over them, so that one
    client's message, however large, cannot push another client over the bound. ``O(K² d³)`` per call:
    ``lax.map`` over clients, each with its ``K`` Cholesky factors (memory ``O(K d²)``).

    :param bounds: ``None`` (the plain sum) or ``(γ, c)`` from :func:`robust_bounds`.
    :return: ``(η_sum, clipped)`` with ``clipped`` a boolean per client; a site within both bounds is
        summed exactly as it was sent.
    :raises MissingCapabilityError: a family whose global precision is not the sum of the sites (low rank).
    """
    if bounds is None:
        return jax.tree.map(lambda e: jnp.sum(e, 0), eta), jnp.zeros(eta.linear.shape[0], bool)
    require(family, SiteSum, "bounded aggregation (max_share/max_shift)", advice=BOUNDS_NEED_SUM)
    share, shift = bounds
    plus = jax.vmap(_psd_part)(eta.precision)
    if capability(family, FixedPrecision):  # the global step ignores the sites' precisions: so do the bounds
        plus = jnp.zeros_like(plus)
    dense = jax.vmap(lambda h, prec: _dense(family, h, prec))(eta.linear, plus)
    prior_dense = _dense(family, prior_nat.linear, prior_nat.precision)

    def one(k) -> tuple[jax.Array, jax.Array, jax.Array]:
        h, site = eta.linear[k], dense[k]
        drop = lambda x: x.at[k].set(jnp.zeros_like(x[k]))  # noqa: E731
        # reference j: the prior and every site but k's and j's (j = k: the others' posterior), from exclusive
        # prefix and suffix sums (no cancellation when one site dominates: the rogue's is never subtracted)
        chol = jnp.linalg.cholesky(prior_dense + leave_one_out(drop(dense)))
        lin = prior_nat.linear + leave_one_out(drop(eta.linear))
        means = jax.vmap(lambda low, b: cho_solve((low, True), b))(chol, lin)
        top = relative_top(chol[k], site)
        s = jnp.where(top > share, share / jnp.maximum(top, share), 1.0)
        pulls = s * (h - means @ site)  # (K, d); the site is symmetric
        norms = jnp.linalg.norm(jax.vmap(lambda low, g: solve_triangular(low, g, lower=True))(chol, pulls), axis=-1)
        best = jnp.argmin(norms)
        c = jnp.where(norms[best] > shift, shift / jnp.maximum(norms[best], shift), 1.0)
        clipped = (s < 1.0) | (c < 1.0)
        new_lin = jnp.where(clipped, s * site @ means[best] + c * pulls[best], h)
        new_prec = jnp.where(clipped, s * plus[k], eta.precision[k])
        return new_lin, new_prec, clipped

    lin, prec, clipped = jax.lax.map(one, jnp.arange(eta.linear.shape[0]))
    return GaussianNatural(jnp.sum(lin, 0), jnp.sum(prec, 0)), clipped


def site_shapes(family, dim) -> tuple[tuple[int], tuple[int, ...]]:
    """Shapes of a site's ``(linear, precision)`` in the family's format."""
    return (dim,), family.precision_shape(dim)


def validate_site(family, arrays, dim, dtype, client, count=2, max_abs=1e12, psd_tol=1e-6, psd=(1,)) -> list[np.ndarray]:
    """Check one client's message (``count`` arrays: site, then e.g. ADMM's local parameters).

    :param arrays: the decoded arrays, in order ``linear, precision[, linear, precision]``.
    :param dtype: the run's floating dtype; anything else (integers, float16, …) is refused.
    :param client: the transport's id of the sender, used in the error.
    :param float max_abs: largest absolute value accepted in any array.
    :param float psd_tol: a site precision's smallest eigenvalue may be down to
        ``−psd_tol · max(1, λ_max)`` (the full and diagonal families).
    :param tuple psd: indices of the precision arrays held to that check (default the site's;
        ``(1, 3)`` adds the local posterior's, which ADMM's server step averages).
    :return: the arrays as NumPy arrays of ``dtype``.
    :raises ClientMessageError: naming the client and what is wrong.
    """
    def bad(msg) -> ClientMessageError:
        return ClientMessageError(f"client {client}: {msg}; its message is rejected and its site left as it was",
                                  client=client)

    arrays = list(arrays)
    if len(arrays) != 2 * count:
        raise bad(f"expected {2 * count} arrays, got {len(arrays)}")
    want = site_shapes(family, dim) * count
    dtype = np.dtype(dtype)
    out = []
    for i, (a, shape) in enumerate(zip(arrays, want)):
        a = np.asarray(a)
        if a.dtype != dtype:
            raise bad(f"array {i} has dtype {a.dtype}, expected {dtype}")
        if a.shape != shape:
            raise bad(f"array {i} has shape {a.shape}, expected {shape}")
        if not np.all(np.isfinite(a)):
            raise bad(f"array {i} holds NaN or infinite values")
        if a.size and np.max(np.abs(a)) > max_abs:
            raise bad(f"array {i} holds values above the bound {max_abs:g}")
        out.append(a)
    for i in psd:
        what = "site precision" if i == 1 else "local precision"
        symmetric, eig = family.precision_spectrum(out[i])
        if not symmetric:
            raise bad(f"the {what} is not symmetric")
        if eig is not None and eig.size and eig[0] < -psd_tol * max(1.0, float(eig[-1])):
            raise bad(f"the {what} is not positive semi-definite (smallest eigenvalue {eig[0]:.3g})")
    return out
