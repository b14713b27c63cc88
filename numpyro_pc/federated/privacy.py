r"""Differential privacy of the clients' sites: the Gaussian mechanism with per-example clipping.

A client's message is its site ``η_k = Σ_j s_j`` with one term ``s_j = (ĥ_j, Ŝ_j)`` per
example (``ĥ_j = Ŝ_j m − ĝ_j`` in the family's format, paper eq. ``local_update``). With a
:class:`GaussianMechanism` the terms are evaluated at the global Gaussian the server sent,
a point that does not depend on this client's data except through its earlier (private)
messages — not at the client's local optimum, which depends on every one of its examples
(:func:`~numpyro_pc.federated.core.local_update` then solves no local problem: the
``ρ → ∞`` limit of the local step) — and the client sends

.. math::
    \tilde\eta_k = \Big(\sum_j c^h_j \hat h_j + C_h \sigma\, \xi,\;
                   \Pi_{\succeq 0}\big[\textstyle\sum_j c^S_j \hat S_j + C_S \sigma\, \Xi\big]\Big),
    \qquad c^h_j = \min\bigl(1, C_h/\|\hat h_j\|\bigr),\; c^S_j = \min\bigl(1, C_S/\|\hat S_j\|_F\bigr),

with ``ξ`` standard normal, ``Ξ`` a symmetric matrix whose upper triangle (diagonal
included) is standard normal (diagonal family: a vector), and ``Π`` the projection onto
positive semi-definite matrices (eigenvalues clipped at zero; post-processing, no privacy
cost). Adding or removing one example changes ``(Σ c^h_j ĥ_j / C_h, Σ c^S_j Ŝ_j / C_S)`` by
at most ``√2`` in Euclidean norm, so one release is the Gaussian mechanism with sensitivity
``√2`` and noise ``σ``: ``1/σ²``-zCDP (Bun & Steinke 2016, Prop. 1.6). ``T`` releases compose
to ``T/σ²``-zCDP (Lemma 1.7, adaptive composition: each message is this mechanism at a
point fixed by the earlier messages), which implies ``(ε, δ)``-DP with
``ε = ρ + 2√(ρ log(1/δ))`` (Prop. 1.3). :class:`GaussianMechanism` solves that for ``σ``
given ``(ε, δ, T)``.

**Exponential-family posteriors** (:mod:`~numpyro_pc.federated.ef`). A site is one flat vector of
``P`` natural parameters, ``η_k = Σ_j s_j`` with ``s_j = −g_j`` the example's term. The client
clips each term to the Euclidean norm ``C_λ`` (``clip_natural``) and adds isotropic noise of
standard deviation ``σ C_λ/√2``:

.. math::
    \tilde\eta_k = \textstyle\sum_j c_j s_j + \tfrac{\sigma C_\lambda}{\sqrt2}\, \xi, \qquad
    c_j = \min\bigl(1, C_\lambda/\|s_j\|\bigr).

One example moves the clipped sum by at most ``C_λ``, so one release is the Gaussian mechanism
with sensitivity ``C_λ`` and noise ``σ C_λ/√2``: ``C_λ²/(2 σ² C_λ²/2) = 1/σ²``-zCDP, the same
budget per release as the Gaussian sites' two blocks, and :meth:`GaussianMechanism.epsilon_after`
is the accounting of both. What the server does when the noised sum of the sites leaves the
family's natural domain is post-processing (:func:`~numpyro_pc.federated.ef_robust.retreat_ef`).

The guarantee is *example-level* (neighbouring shards differ by one example of that
client), holds against the server and anyone who sees the messages, and needs that the
client sends at most ``T`` messages: the in-process :func:`~numpyro_pc.federated.run`
refuses runs that could send more, and the Flower client
(:class:`~numpyro_pc.federated.flower.ClientLogic`) counts its releases and stops with
:class:`~numpyro_pc.errors.PrivacyError` once they are spent. It does not cover the number of
examples a Flower client reports (used for ``min_examples``), nor which clients take part.
The clipping and the noise move the fixed point away from the joint posterior
(``benchmarks/RESULTS.md`` measures the cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.families.registry import GaussianNatural
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.ops.merging import gaussian_prior

from ..errors import InvalidOptionError, PrivacyError

__all__ = ["GaussianMechanism", "add_noise", "clip_factors", "clip_rows", "finite_rows", "add_noise_natural",
           "check_same_on_every_row", "check_gaussian_prior_data_free"]


@dataclass(frozen=True)
class GaussianMechanism:
    """Gaussian noise on the clipped site sums, calibrated to ``(ε, δ)`` over ``releases`` messages.

    :param float epsilon: the privacy loss ``ε > 0`` of all releases together.
    :param float delta: ``δ ∈ (0, 1)``, typically below ``1/N``.
    :param int releases: messages a client may send under this budget (the in-process run
        needs ``rounds`` plus one for ``init="prior"``; Flower: ``rounds + 1``).
    :param float clip_linear: ``C_h``, the largest norm of one example's linear site term.
    :param float clip_precision: ``C_S``, the largest Frobenius norm of one example's site
        precision term.
    :param float clip_natural: ``C_λ``, the largest Euclidean norm of one example's term of an
        exponential-family site (a flat vector of natural parameters).
    """

    epsilon: float
    delta: float
    releases: int
    clip_linear: float = 1.0
    clip_precision: float = 1.0
    clip_natural: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epsilon", "clip_linear", "clip_precision", "clip_natural"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidOptionError(f"GaussianMechanism.{name} must be a positive finite number, got {value!r}")
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise InvalidOptionError(f"GaussianMechanism.delta must lie in (0, 1), got {self.delta!r}")
        if not (isinstance(self.releases, int) and self.releases >= 1):
            raise InvalidOptionError(f"GaussianMechanism.releases must be a positive integer, got {self.releases!r}")

    @property
    def zcdp(self) -> float:
        """The zCDP budget ``ρ`` whose conversion gives exactly ``(ε, δ)``."""
        log = math.log(1.0 / self.delta)
        return (math.sqrt(log + self.epsilon) - math.sqrt(log)) ** 2

    @property
    def noise(self) -> float:
        """``σ``: the noise standard deviation in units of the clipping norms."""
        return math.sqrt(self.releases / self.zcdp)

    def epsilon_after(self, releases) -> float:
        """``ε`` spent after ``releases`` messages (at this ``δ``)."""
        rho = releases / self.noise**2
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / self.delta))


def clip_factors(site_terms, mech) -> tuple[jax.Array, jax.Array]:
    """Per-example factors ``(c^h_j, c^S_j)`` of the module docstring for stacked site terms.

    An example whose linear or precision term holds a non-finite value (NaN or ∞: no norm to clip)
    gets 0 for both factors — the example is dropped, as :func:`clip_rows` drops an
    exponential-family row; its terms must then be zeroed too (:func:`finite_rows`), since
    ``0 · NaN`` is NaN.
    """
    lin = jnp.linalg.norm(site_terms.linear, axis=-1)
    n = site_terms.linear.shape[0]
    prec = jnp.linalg.norm(jnp.reshape(site_terms.precision, (n, -1)), axis=-1)
    finite = jnp.all(jnp.isfinite(site_terms.linear), -1) & jnp.all(
        jnp.isfinite(jnp.reshape(site_terms.precision, (n, -1))), -1)
    scale = lambda norm, c: jnp.where(finite & (norm <= c), 1.0, jnp.where(  # noqa: E731
        finite, c / jnp.maximum(norm, c), 0.0))
    return scale(lin, mech.clip_linear), scale(prec, mech.clip_precision)


def clip_rows(terms, bound) -> jax.Array:
    """``min(1, bound/‖t_j‖)`` for each row ``t_j`` of ``terms`` ``(N, P)``: the factor that clips it to ``bound``;
    0 for a row with a non-finite value (NaN or ∞ have no norm to clip: the row is dropped, see
    :func:`finite_rows`, so that one example cannot break the release outside the mechanism)."""
    norm = jnp.linalg.norm(terms, axis=-1)
    factor = jnp.where(norm > bound, bound / jnp.maximum(norm, bound), 1.0)
    return jnp.where(jnp.all(jnp.isfinite(terms), -1), factor, 0.0)


def finite_rows(terms) -> jax.Array:
    """``terms`` ``(N, P)`` with every row that holds a non-finite value set to 0 (what :func:`clip_rows` drops)."""
    return jnp.where(jnp.all(jnp.isfinite(terms), -1, keepdims=True), terms, 0.0)


def add_noise_natural(mech, site, key) -> jax.Array:
    """An exponential-family release: the clipped sum ``site`` ``(P,)`` plus noise of standard deviation
    ``σ C_λ/√2`` in every coordinate (module docstring: ``1/σ²``-zCDP, as a Gaussian site)."""
    sd = jnp.asarray(mech.noise * mech.clip_natural / math.sqrt(2.0), site.dtype)
    return site + sd * jax.random.normal(key, site.shape, site.dtype)


def add_noise(family, mech, site, key) -> GaussianNatural:
    """The released site: ``site`` (clipped sums) plus the mechanism's noise, precision projected to PSD."""
    k_lin, k_prec = jax.random.split(key)
    sd = jnp.asarray(mech.noise, site.linear.dtype)
    linear = site.linear + sd * mech.clip_linear * jax.random.normal(k_lin, site.linear.shape, site.linear.dtype)
    precision = family.noisy_precision(site.precision, k_prec, sd * mech.clip_precision)
    return GaussianNatural(linear, precision)


def check_same_on_every_row(term, datas, what: str, sent: str) -> None:
    """Refuse a term that should not depend on the data but differs between rows (a private run's prior).

    ``term`` is evaluated on the first and last row of every shard; a term free of the data is the same
    on all of them (to 64 units of rounding). A dependence on rows that are all equal cannot be seen, and
    reveals nothing beyond them.

    :param term: ``ModelData`` of one row → an array.
    :param datas: the clients' :class:`~numpyro_pc.model.likelihood.ModelData`.
    :param str what: the term, for the message (``"the prior term"``).
    :param str sent: what the run would send outside the mechanism, for the message.
    :raises PrivacyError: the term differs between two rows, naming them and the difference.
    """
    ref, first = None, None
    for k, data in enumerate(datas):
        n = int(data.per_example[0].shape[0])
        for j in sorted({0, n - 1}):
            value = np.ravel(np.asarray(term(ModelData(tuple(x[j:j + 1] for x in data.per_example), data.shared))))
            if ref is None:
                ref, first = value, (k, j)
                continue
            tol = 64 * np.finfo(value.dtype).eps * (1.0 + np.max(np.abs(ref)))
            if not np.all(np.abs(value - ref) <= tol):
                raise PrivacyError(
                    f"{what} differs between client {first[0]}'s row {first[1]} and client {k}'s row {j} (by up to "
                    f"{np.max(np.abs(value - ref)):.3g}, expected equal to {tol:.1g}): the prior depends on the data. "
                    f"A private run sends {sent} outside the mechanism, which covers only the examples' terms, so "
                    "it would reveal the data; write the prior without the data (or run without privacy)")


def check_gaussian_prior_data_free(spec, datas) -> None:
    """Refuse a Gaussian prior that depends on the data in a private run (the Gaussian counterpart of
    :func:`~numpyro_pc.federated.ef.check_prior_data_free`): the prior ``(m_0, P_0)`` leaves outside the
    mechanism, and a prior written with the data (``Normal(mean(y), 1)``) would reveal it.

    :param spec: the model binding (:class:`~numpyro_pc.model.likelihood.ModelSpec`).
    :param datas: the clients' :class:`~numpyro_pc.model.likelihood.ModelData`.
    :raises PrivacyError: the prior differs between two rows (:func:`check_same_on_every_row`).
    """
    one = replace(spec, num_examples=1)

    def prior(data: ModelData) -> np.ndarray:
        q0 = gaussian_prior(one, data)
        return np.concatenate([np.ravel(np.asarray(q0.mean)), np.ravel(np.asarray(q0.precision))])

    check_same_on_every_row(prior, datas, "the prior", "the prior's mean and precision")
