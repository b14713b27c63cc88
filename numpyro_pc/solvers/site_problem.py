r"""The dual-form fixed-point problem of a Gaussian posterior: its live terms and what they sum to.

A :class:`SiteProblem` names the live terms — the prior site, the examples' sites, a fixed
Gaussian ``base`` factor — and how their sites are computed. :func:`live_totals` sums them at
``q`` (gradient, curvature in the family's format, dense curvature, loss), from which follow
the two dual-form residuals (:func:`dual_residual`, docs/notation.md), the variational
objective, and the undamped fixed-point map :math:`T(m, S)` (:func:`fixed_point_map`) whose
fixed points are the dual-form solutions. The drivers that iterate the map are
:func:`numpyro_pc.solvers.gaussian.solve` (host) and :func:`numpyro_pc.kernels.stream_state.iterate` (traced).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pc.errors import NonFiniteResultError
from numpyro_pc.families.registry import Gaussian
from numpyro_pc.model.rows import all_finite
from numpyro_pc.protocols.capabilities import needs_dense_sum
from numpyro_pc.sites.gaussian import compute_sites
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["SiteProblem", "live_totals", "dual_residual", "problem_totals", "residual_from_totals", "Point",
           "evaluate", "objective_from_totals", "check_finite_sites", "fixed_point_map", "point_rule", "base_terms"]


class SiteProblem(NamedTuple):
    """A dual-form fixed-point problem: which terms are live and how their sites are computed.

    The target is ``q ∝ base(z) · exp(−ℓ_0(z))^{[include_prior]} · Π_i exp(−ℓ_i(z))`` over the
    examples in ``data``, where ``base`` is a fixed (possibly improper) Gaussian factor in
    natural parameters — e.g. the old posterior with the sites of corrected examples
    divided out (docs/adapting.md, "Adding data" and "Deleting data").
    """

    spec: object
    data: object
    family: object
    rule: object
    curvature: str | None
    storage: str | None
    chunk_size: int | None
    ids: object
    base: object = None
    include_prior: bool = True
    weights: object = None

    def sites(self, q, need_hessian_sum=False) -> tuple:
        """``(Sites, SiteSums)`` of the live examples at ``q`` (:func:`~numpyro_pc.sites.gaussian.compute_sites`
        with the problem's options)."""
        return compute_sites(self.spec, self.data, self.family, q, self.rule, curvature=self.curvature,
                             storage=self.storage, chunk_size=self.chunk_size, ids=self.ids,
                             need_hessian_sum=need_hessian_sum, weights=self.weights)


def base_terms(family, q, base, point_loss=False) -> tuple[Any, Any, Any, Any]:
    """Gradient, family-format and dense curvature, and loss of a Gaussian factor.

    The factor ``exp(bᵀz − ½ zᵀBz)`` contributes the loss ``½ zᵀBz − bᵀz``: its expectation
    under ``q`` (``+ ½ tr(BΣ)``), or its value at the mean when ``point_loss``.
    """
    b_mean = family.natural(Gaussian(q.mean, base.precision)).linear  # B m
    grad = b_mean - base.linear
    dense_b = family.dense_precision(Gaussian(q.mean, base.precision)) if needs_dense_sum(family, q.mean.shape[0]) else None
    loss = 0.5 * q.mean @ b_mean - base.linear @ q.mean
    if not point_loss:
        loss = loss + 0.5 * family.trace_with_covariance(q, base.precision)
    return grad, base.precision, dense_b, loss


def point_rule(problem) -> bool:
    """Whether the problem's sites are evaluated at the mean alone (the delta rule): then they do not
    depend on the precision, and neither does the objective (the MAP loss)."""
    return problem.rule is not None and problem.rule.kind == "delta"


def problem_totals(problem, q, sites, sums=None) -> tuple[Any, Any, Any, Any, Any]:
    """Sums over the live terms: gradient, Σ‖gradients‖, curvature (family format), dense curvature, loss."""
    return live_totals(problem.family, bool(problem.include_prior), q, sites, sums, problem.base, problem.weights,
                       point_loss=point_rule(problem))


@partial(jax.jit, static_argnums=(0, 1), static_argnames=("point_loss",))
def live_totals(family, include_prior, q, sites, sums, base, weights, point_loss=False) -> tuple[Any, Any, Any, Any, Any]:
    """Sums over a problem's live terms at ``q`` (pure; the solver's and :mod:`numpyro_pc.kernels.site_table`'s).

    :param family: the :class:`~numpyro_pc.families.registry.GaussianFamily` (static).
    :param bool include_prior: whether the prior site is a live term (static).
    :param q: the current member.
    :param sites: the live examples' :class:`~numpyro_pc.sites.gaussian.Sites` (their prior site is used
        when ``include_prior``).
    :param sums: their :class:`~numpyro_pc.sites.gaussian.SiteSums`, or ``None`` (no dense curvature and loss).
    :param base: a fixed Gaussian factor in natural parameters, or ``None``.
    :param weights: per-example weights of the live examples, or ``None`` (all 1).
    :param bool point_loss: the base factor's loss at the mean rather than its expectation (static;
        the delta rule, whose example and prior losses are values at the mean).
    :return: ``(gradient, Σ‖gradients‖, target precision in the family's format, dense
        curvature or None, expected loss or None)``.
    """
    grad, norms = sites.grad_totals(q.mean, weights)
    w = jnp.ones(sites.num_examples, grad.dtype) if weights is None else weights
    dense = None if sums is None or not needs_dense_sum(family, q.mean.shape[0]) else sums.hessian
    loss = None if sums is None else sums.loss
    prior_curvature = b_curv = None
    if include_prior:
        p_grad = sites.prior_grad_at(q.mean)
        grad, norms = grad + p_grad, norms + jnp.linalg.norm(p_grad)
        prior_curvature = sites.prior_curvature
        dense = None if dense is None else dense + sites.prior_curvature_dense()
        loss = None if loss is None else loss + sites.prior_loss
    if base is not None:
        b_grad, b_curv, b_dense, b_loss = base_terms(family, q, base, point_loss)
        grad, norms = grad + b_grad, norms + jnp.linalg.norm(b_grad)
        dense = None if dense is None else dense + b_dense
        loss = None if loss is None else loss + b_loss
    # the family forms the target from all its parts at once (a non-linear projection sees their sum)
    curv = family.target_precision(sites.curv, w, prior_curvature, b_curv)
    if not needs_dense_sum(family, q.mean.shape[0]):  # a matrix-free family may still precondition the mean with Σ Ĥ_i
        dense = family.newton_operator(sites.curv, w, prior_curvature, b_curv)
    return grad, norms, curv, dense, loss


def dual_residual(family, q, sites, base=None, include_prior=True, weights=None) -> tuple:
    """Relative residuals of the two dual-form identities (docs/notation.md, "Dual-form residual").

    With ``∇ℓ̂_i(m) = ĝ_i + Ĥ_i (m − m_i)`` the gradient of site ``i`` at the mean (equal to
    ``ĝ_i`` for a site computed at ``q`` itself):

    ``mean = ‖Σ_i ∇ℓ̂_i(m)‖ / Σ_i ‖∇ℓ̂_i(m)‖`` (the site gradients cancel at the mean) and
    ``precision = ‖S − Σ_i Ĥ_i‖_F / ‖S‖_F`` (zero by construction for the isotropic family,
    whose precision is fixed); sums run over the prior site, the example sites and an
    optional fixed Gaussian ``base`` factor; example sites may carry ``weights``.

    :return: ``(residual, {"mean": ..., "precision": ...})`` with ``residual`` the larger.
    """
    if sites.num_examples:  # bucket-padded with weight-0 copies: a growing stream reuses a few compilations
        sites, weights = sites.bucketed(weights)
    problem = SiteProblem(None, None, family, None, None, None, None, None, base, include_prior, weights)
    return residual_from_totals(family, q, problem_totals(problem, q, sites))


_NO_CANCELLATION = 1.0 - 1e-6  # a relative mean residual this close to 1: the live gradients do not cancel at all


def residual_from_totals(family, q, totals) -> tuple:
    """``(residual, {"mean": ..., "precision": ...})`` from a problem's totals (see :func:`dual_residual`).

    The relative mean residual ``‖Σ_i ∇ℓ̂_i(m)‖ / Σ_i ‖∇ℓ̂_i(m)‖`` is 1 whenever the live gradients do
    not cancel at all — always when a single term is live (the prior alone, after every example
    was deleted), however small its gradient. There the mean residual is the smaller of that
    ratio and the length of the Newton step in posterior standard deviations,
    ``(gᵀ S⁻¹ g)^{1/2}``, which measures the same distance to the fixed point without the
    cancellation.
    """
    grad, norms, curv = totals[:3]
    r_mean = float(jnp.linalg.norm(grad) / jnp.maximum(norms, jnp.finfo(grad.dtype).tiny))
    if r_mean > _NO_CANCELLATION:  # min(): a NaN step (precision not positive definite) keeps the ratio
        r_mean = min(r_mean, float(jnp.sqrt(family.quad_form_cov(q, family.covariance_operand(q), grad))))
    r_prec = float(family.precision_residual(q.precision, curv))
    return max(r_mean, r_prec), {"mean": r_mean, "precision": r_prec}


class Point(NamedTuple):
    """An evaluated iterate: its sites, their sums over the live terms, residual and objective."""

    q: Gaussian
    sites: Any
    totals: tuple
    residual: float
    parts: dict
    objective: float


def evaluate(problem, q, sites, sums) -> Point:
    """Residual and objective of ``q`` from one pass over its sites' totals.

    Under the delta rule the sites, their totals and the objective depend on the mean alone, so
    the precision the fixed point asks for at that mean, ``S = T(m)``, is known as soon as the
    sites are: the point takes it (when it is positive definite), and the precision identity
    then holds by construction. Without this a trial that moves the mean carries the precision
    of the previous mean, and the solver ends up trading one identity against the other (an
    uncorrected update of the digits network wandered between residuals 0.01 and 0.2 for 35
    iterations). The fixed points are unchanged: ``∇L(m) = 0`` and ``S = T(m)``.
    """
    totals = problem_totals(problem, q, sites, sums)
    if point_rule(problem):
        family = problem.family
        own, _ = family.fixed_point(q, totals[2], totals[3])
        if bool(family.is_positive_definite(own)):
            q = Gaussian(q.mean, own)
    res, parts = residual_from_totals(problem.family, q, totals)
    return Point(q, sites, totals, res, parts, objective_from_totals(problem, q, totals))


def objective_from_totals(problem, q, totals) -> float:
    """Variational objective ``Σ E_q[live losses] − H(q)`` (the MAP loss for the delta rule)."""
    value = totals[4]
    if problem.rule.kind != "delta":
        value = value - problem.family.entropy(q)
    return float(value)


def check_finite_sites(sites) -> None:
    if not (all_finite(sites.grad) and all_finite(sites.prior_grad)):
        raise NonFiniteResultError(
            "site gradients are not finite at the current posterior; the model's log density is NaN/inf "
            "somewhere the posterior puts mass (check priors, constraints and the data)."
        )


def fixed_point_map(problem, point) -> tuple[Any, Any]:
    """The undamped step ``T(m, S)`` (``ρ = 1``); its fixed points are the dual-form solutions."""
    grad, _, target, dense, _ = point.totals
    target, pre = problem.family.fixed_point(point.q, target, dense)
    return -problem.family.precondition(pre, grad), target
