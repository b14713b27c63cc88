r"""What the server does not take on trust: message validation and bounded aggregation.

**Validation** (:func:`validate_site`, host side, before anything is stored). A client's
message must have the expected number of arrays, the exact shapes and floating dtype of
the run, finite values below a size bound, and — for the full and diagonal families — a
positive semi-definite site precision (up to a relative tolerance). A message that fails
raises :class:`~numpyro_pc.errors.ClientMessageError` naming the client; the server then
leaves that client's stored site unchanged and excludes it from the round.

**Bounded aggregation** (:func:`aggregate_sites`, traced, ``vmap``-ed over clients). With
``P_{-k}, m_{-k}`` the global precision and mean *without* client ``k``'s site, each site
``(h_k, S_k)`` is replaced by

.. math::
    S_k' = s_k S_k, \quad s_k = \min\bigl(1, \gamma / \lambda_{\max}(P_{-k}^{-1} S_k)\bigr), \qquad
    h_k' = S_k' m_{-k} + c_k\, g_k, \quad g_k = s_k (h_k - S_k m_{-k}),

with ``c_k = min(1, c / ‖g_k‖_{P_{-k}^{-1}})``. A site kept within both bounds is left
unchanged. Then, whatever client ``k`` sends,

.. math:: P \preceq (1 + \gamma)\, P_{-k} \quad\text{and}\quad \|m - m_{-k}\|_{P_{-k}} \le c,

i.e. one client can sharpen the global posterior by at most the factor ``1 + γ`` in any
direction and move its mean by at most ``c`` standard deviations of the others' posterior
(``m − m_{-k} = (P_{-k} + S_k')^{-1} c_k g_k``). The bound is exact for the client being
clipped when the other clients are within their own bounds. An honest client whose data
carries more than that share of the information is clipped too: the fixed point is then no
longer the joint posterior (``benchmarks/RESULTS.md`` measures the cost), so the option is off
by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from numpyro_pc.families.registry import Gaussian, GaussianNatural

from ..errors import ClientMessageError, InvalidOptionError
from .core import relative_top

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


def aggregate_sites(family, prior_nat, eta, bounds) -> tuple[GaussianNatural, jax.Array]:
    """Sum of the client sites ``η`` (stacked on axis 0), each bounded as in the module docstring.

    :param bounds: ``None`` (the plain sum) or ``(γ, c)`` from :func:`robust_bounds`.
    :return: ``(η_sum, clipped)`` with ``clipped`` a boolean per client.
    """
    if bounds is None:
        return jax.tree.map(lambda e: jnp.sum(e, 0), eta), jnp.zeros(eta.linear.shape[0], bool)
    share, shift = bounds
    dense = jax.vmap(lambda h, prec: _dense(family, h, prec))(eta.linear, eta.precision)
    prior_dense = _dense(family, prior_nat.linear, prior_nat.precision)
    # the others' sums from exclusive prefix and suffix sums: no cancellation when one site dominates
    rest_lin = prior_nat.linear + leave_one_out(eta.linear)
    rest_prec = prior_dense + leave_one_out(dense)

    def one(h, site, r_lin, r_prec, prec) -> tuple[GaussianNatural, jax.Array]:
        chol = jnp.linalg.cholesky(r_prec)
        mean_rest = jax.scipy.linalg.cho_solve((chol, True), r_lin)
        top = relative_top(chol, site)
        s = jnp.where(top > share, share / jnp.maximum(top, share), 1.0)
        pull = s * (h - site @ mean_rest)
        norm = jnp.linalg.norm(solve_triangular(chol, pull, lower=True))
        c = jnp.where(norm > shift, shift / jnp.maximum(norm, shift), 1.0)
        new = GaussianNatural(s * site @ mean_rest + c * pull, s * prec)
        return new, (s < 1.0) | (c < 1.0)

    bounded, clipped = jax.vmap(one)(eta.linear, dense, rest_lin, rest_prec, eta.precision)
    return jax.tree.map(lambda e: jnp.sum(e, 0), bounded), clipped


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
