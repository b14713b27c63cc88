r"""Model merging as posterior correction (paper §3.3; docs/merging.md).

Given a shared *base* posterior ``q_pre`` (a pre-trained model, or the prior) and task
posteriors ``q_i`` obtained from it on separate data (``q_i ∝ q_pre · exp(−ℓ̂_i)``, e.g.
``base.update(X_i, y_i, correction="none")``, or :func:`numpyro_pc.fit` on disjoint
shards when the base is the prior), :func:`merge` combines them with weights ``α_i``:

``"bayesian"`` — Bayesian arithmetic (paper eq. ``ba``) on natural parameters, the base
    counted once:

    .. math:: \lambda_{BA} = \lambda_{pre} + \textstyle\sum_i \alpha_i (\lambda_i - \lambda_{pre}).

    With a Gaussian likelihood, the full family and ``α_i = 1`` this *is* the joint
    posterior; otherwise the error is the sum of the task corrections
    ``E_q[ℓ_i − ℓ̂_i]`` of paper eq. ``postcorr_merging``.

``"task_arithmetic"`` — the isotropic case of Bayesian arithmetic on the means
    (paper eq. ``ta``): ``m = m_pre + Σ α_i (m_i − m_pre)``. The merged precision is the
    Bayesian-arithmetic one, so that comparisons between methods isolate the mean.

``"hessian"`` — the corrections approximated to second order with the exact Hessians of
    the losses at each model's mean (paper eq. ``ha``, appendix "Derivation of eq. ha"):

    .. math::
        m = m_{pre} + H^{-1} \textstyle\sum_i \alpha_i (K + H_i)(m_i - m_{pre}), \qquad
        H = H_{pre} + \textstyle\sum_i \alpha_i H_i ,

    with ``H_i = ∇²ℓ_i(m_i)`` summed over the examples task ``i`` added,
    ``H_pre = ∇²(ℓ_0 + ℓ_pre)(m_pre)`` (prior included) and ``K`` the precision of the
    fine-tuning regulariser ``KL(q ‖ q_pre)`` (the base precision; the paper's ``I``
    comes from its isotropic unit-covariance family and its ``H_ha = I + H_llm + Σα_iH_i``
    counts that prior inside ``H_pre`` here). It is exact for quadratic losses.

``"precision"`` — the twin of ``"hessian"`` with posterior precisions instead of
    Hessians: ``H_pre → S_pre`` and ``H_i → S_i − S_pre`` (the task's share of the
    precision). For Gaussian posteriors this equals Bayesian arithmetic exactly — the
    paper's remark that a richer family performs the reduction by itself.

The result is a :class:`~numpyro_pc.posterior.DualPosterior` over the union of the data
(base examples, then each task's own examples), its sites evaluated at the merged
Gaussian; :meth:`~numpyro_pc.posterior.DualPosterior.refine` then reaches the joint
posterior (retraining from the merged start).

Exponential-family posteriors (:class:`~numpyro_pc.dual.expfam.EFPosterior`) merge by
Bayesian arithmetic on their natural parameters, with a base or from the prior and with any
weights, the sites attributed so that the result stays in dual form (exact for conjugate
models); the other three methods are defined by Gaussian means, Hessians and precisions and
are refused for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.build import build_posterior
from numpyro_pc.dual.expfam import EFPosterior, EFState
from numpyro_pc.errors import (
    IncompatiblePosteriorsError,
    InvalidOptionError,
    NonFiniteResultError,
    NotPositiveDefiniteError,
    OutOfDomainError,
    UnsupportedModelError,
)
from numpyro_pc.families.registry import Gaussian, GaussianNatural
from numpyro_pc.model.likelihood import example_loss, losses, prior_loss
from numpyro_pc.model.rows import concat_data, positions, take_data
from numpyro_pc.model.terms import ModelData
from numpyro_pc.options import is_choice
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.protocols.posterior import Posterior, by_site_table, provides
from numpyro_pc.protocols.records import MergeInfo
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.solvers.fixed_point import default_tol

__all__ = ["METHODS", "merge", "gaussian_prior", "prior_natural"]

METHODS = ("bayesian", "task_arithmetic", "hessian", "precision")


def gaussian_prior(spec, data) -> Gaussian:
    """The prior ``ℓ_0`` as a Gaussian ``(m_0, P_0)`` in unconstrained space.

    ``ℓ_0`` must be quadratic in ``z`` (a Gaussian prior on unconstrained latents, e.g.
    ``Normal`` priors on real-valued weights); the Hessian is compared at two points.

    :raises UnsupportedModelError: when the prior is not Gaussian in ``z`` or not proper.
    :return: :class:`~numpyro_pc.families.registry.Gaussian` with a dense ``(d, d)`` precision.
    """
    d = spec.latent.dim
    dtype = jnp.result_type(float)
    zero = jnp.zeros(d, dtype)
    other = zero + 0.37 + 0.1 * jnp.arange(d, dtype=dtype)
    fn = lambda z: prior_loss(spec, z, data)  # noqa: E731
    h0, h1 = jax.hessian(fn)(zero), jax.hessian(fn)(other)
    if not bool(jnp.allclose(h0, h1, rtol=1e-6, atol=1e-9)):
        raise UnsupportedModelError(
            "this operation needs a Gaussian prior on the unconstrained latents (ℓ_0 quadratic in z); "
            f"the prior Hessian changes with z (latent sites {spec.latent.names}). Fit the prior into a "
            "posterior first and pass it as the base.")
    prec = 0.5 * (h0 + h0.T)
    chol = jnp.linalg.cholesky(prec)
    if not bool(jnp.all(jnp.isfinite(chol))):
        raise UnsupportedModelError("the prior on the unconstrained latents is not a proper Gaussian "
                                    "(its precision is not positive definite)")
    mean = jax.scipy.linalg.cho_solve((chol, True), -jax.grad(fn)(zero))
    return Gaussian(mean, prec)


def prior_natural(family, prior, tau=None) -> GaussianNatural:
    """Natural parameters of a dense Gaussian ``prior`` in ``family``'s format.

    The diagonal family needs a diagonal prior precision; the isotropic family keeps its
    fixed precision ``tau`` (the prior's curvature enters through its base measure).
    """
    return family.prior_natural(prior, tau)


def _weights(alphas) -> list:
    """The merge weights as floats (range checks follow in the callers)."""
    try:
        return [float(a) for a in np.ravel(np.asarray(alphas, dtype=float))]
    except (TypeError, ValueError) as err:
        raise InvalidOptionError(f"alphas must be numbers, one weight per posterior; got {alphas!r}") from err


def _check(base, posts, alphas, method) -> tuple[list[Posterior], list[float]]:
    if not is_choice(method, METHODS):
        raise InvalidOptionError(f"unknown merge method {method!r}; expected one of {METHODS}")
    posts = list(posts)
    if not posts:
        raise InvalidOptionError("merge needs at least one task posterior, got an empty list")
    alphas = [1.0] * len(posts) if alphas is None else _weights(alphas)
    if len(alphas) != len(posts):
        raise InvalidOptionError(f"got {len(alphas)} alphas for {len(posts)} posteriors; expected one weight per posterior")
    _check_weights(alphas)
    ref = posts[0]
    for k, p in enumerate(posts + ([base] if base is not None else [])):
        what = "base" if k == len(posts) else f"posterior {k}"
        if p.latent.signature() != ref.latent.signature():
            raise IncompatiblePosteriorsError(
                f"{what} has latent sites {p.latent.signature()}, expected {ref.latent.signature()} "
                "(merging needs posteriors of the same model)")
        if p.family.name != ref.family.name:
            raise IncompatiblePosteriorsError(f"{what} is in the {p.family.name} family, expected {ref.family.name}")
        if p.mean.dtype != ref.mean.dtype:
            raise IncompatiblePosteriorsError(f"{what} computes in {p.mean.dtype}, expected {ref.mean.dtype}")
        if p.spec.observed != ref.spec.observed:
            raise IncompatiblePosteriorsError(f"{what} observes {p.spec.observed}, expected {ref.spec.observed}")
        _check_retained(p, what)
    with jax.enable_x64(ref.mean.dtype == jnp.float64):
        for k, p in enumerate(posts[1:] + ([base] if base is not None else []), 1):
            _check_same_terms(ref, p, "base" if k == len(posts) else f"posterior {k}")
    return posts, alphas


def _check_retained(post, what) -> None:
    if post.num_retained != post.num_examples:
        raise IncompatiblePosteriorsError(
            f"{what} dropped the data of {post.num_examples - post.num_retained} example(s); merging joins the "
            "posteriors' sites and data example by example and needs every example's data (keep='all')")


def _check_weights(alphas) -> None:
    """Refuse weights that are negative or not finite (naming the first such weight).

    A merge adds ``α_k`` times each task's share of the natural parameters to the base; a
    negative weight subtracts precision, and the result is no longer a distribution for any
    task that carries information (before this check it surfaced as a "non-finite mean").
    """
    for k, a in enumerate(alphas):
        if not (np.isfinite(a) and a >= 0.0):
            raise InvalidOptionError(f"merge weight alphas[{k}] = {a!r}; expected a finite weight ≥ 0 (a negative "
                                     "weight subtracts a task's precision: to remove a task's examples use "
                                     "post.delete(ids))")


def _check_same_terms(ref, post, what) -> None:
    """Refuse ``post`` unless its prior term and likelihood are ``ref``'s, probed at both means.

    The merge adds natural parameters relative to one prior (the base's, or the model's): a
    posterior fitted under another prior (``N(0, 10)`` against ``N(0, 1)``) or another
    likelihood would be combined as if its sites belonged to ``ref``'s model, silently wrong.

    :raises IncompatiblePosteriorsError: naming the term, the probe and both values.
    """
    rtol = 1e-8 if ref.mean.dtype == jnp.float64 else 1e-4
    example = tuple(x[0] for x in post.data.per_example) if post.num_retained else None
    for where, z in (("posterior 0's mean", ref.mean), (f"{what}'s mean", post.mean)):
        terms = [("prior", prior_loss(ref.spec, z, ref.data), prior_loss(post.spec, z, post.data))]
        if example is not None:
            terms.append((f"likelihood of {what}'s first example", example_loss(ref.spec, z, example, post.data.shared),
                          example_loss(post.spec, z, example, post.data.shared)))
        for term, a, b in terms:
            a, b = float(a), float(b)
            if not abs(a - b) <= rtol * (1.0 + abs(a)):
                raise IncompatiblePosteriorsError(
                    f"{what} was fitted under another {term.split(' of ')[0]} than posterior 0: at {where} the "
                    f"negative log {term} is {b:.6g} under {what}'s model, expected {a:.6g} (posterior 0's); "
                    "merging adds natural "
                    "parameters relative to one shared prior and model (refit one posterior under the other's prior "
                    "and likelihood)")


def _task_rows(post, base) -> np.ndarray:
    """Rows of ``post``'s data that its task added on top of ``base`` (all rows without a base)."""
    ids = np.asarray(post.data_ids)
    if base is None:
        return np.arange(ids.size)
    return np.flatnonzero(~np.isin(ids, np.asarray(base.data_ids)))


def _take(data, rows) -> ModelData:

    return take_data(data, rows)


def _loss_hessian(post, data, at, with_prior) -> jax.Array:
    fn = lambda z: jnp.sum(losses(post.spec, z, data)) if data.per_example[0].shape[0] else 0.0  # noqa: E731
    total = (lambda z: fn(z) + prior_loss(post.spec, z, data)) if with_prior else fn
    h = jax.hessian(total)(at)
    return 0.5 * (h + h.T)


def _merged_state(family, base_q, base_nat, posts, alphas, method, task_data, base_hessian) -> Gaussian:
    ba = family.arithmetic(base_nat, [p.natural for p in posts], alphas)
    if method == "bayesian":
        return family.from_natural(ba)
    if method == "task_arithmetic":
        mean = base_q.mean + sum(a * (p.mean - base_q.mean) for a, p in zip(alphas, posts))
        return Gaussian(mean, ba.precision)
    dense = lambda prec: family.dense_precision(Gaussian(base_q.mean, prec))  # noqa: E731
    k_reg = dense(base_q.precision)
    if method == "precision":
        h_pre = k_reg
        h_tasks = [family.dense_precision(p.state) - k_reg for p in posts]
    else:
        h_pre = base_hessian
        h_tasks = [_loss_hessian(p, data, p.mean, False) for p, data in zip(posts, task_data)]
    h = h_pre + sum(a * ht for a, ht in zip(alphas, h_tasks))
    rhs = sum(a * (k_reg + ht) @ (p.mean - base_q.mean) for a, ht, p in zip(alphas, h_tasks, posts))
    chol = jnp.linalg.cholesky(h)
    if not bool(jnp.all(jnp.isfinite(chol))):

        raise NotPositiveDefiniteError(f"the {method} merge's precision H = H_pre + Σ α_i H_i is not positive "
                                       "definite (non-convex losses at the task means)")
    mean = base_q.mean + jax.scipy.linalg.cho_solve((chol, True), rhs)
    return Gaussian(mean, family.keep_fixed(base_q.precision, family.project_curvature(h)))


@provides("merge")
def merge(base: Posterior | None, posteriors: Sequence[Posterior], alphas: Sequence[float] | None = None,
          method: str = "bayesian", rule=None) -> Posterior:
    """Merge task posteriors fitted from a shared base (see the module docstring).

    :param base: the shared :class:`~numpyro_pc.posterior.DualPosterior` the tasks started
        from, or ``None`` for the model's prior (which must then be Gaussian in
        unconstrained space, see :func:`gaussian_prior`).
    :param posteriors: task posteriors of the same model and family.
    :param alphas: one weight per task (default all ``1``).
    :param str method: ``"bayesian"``, ``"task_arithmetic"``, ``"hessian"`` or ``"precision"``.
    :param rule: expectation rule of the merged posterior's sites (default: the first
        task's).
    :raises IncompatiblePosteriorsError: different latent sites, families, dtypes, or
        posteriors without their data; a mix of Gaussian and Beta/Gamma/Dirichlet posteriors.
    :return: a :class:`~numpyro_pc.posterior.DualPosterior` on the union of the data whose
        ``record`` holds the method and weights (an :class:`~numpyro_pc.dual.expfam.EFPosterior`
        for Beta/Gamma/Dirichlet posteriors, see the module docstring).
    """
    if isinstance(posteriors, Posterior):
        raise InvalidOptionError(f"merge takes a base (or None) and a list of posteriors; found one "
                                 f"{type(posteriors).__name__} as posteriors (write pc.merge(None, [a, b]))")
    if not isinstance(posteriors, Iterable) or isinstance(posteriors, (str, bytes)):
        raise InvalidOptionError(f"merge takes a base (or None) and a list of posteriors; found "
                                 f"{type(posteriors).__name__} as posteriors (write pc.merge(None, [a, b]))")
    posteriors = list(posteriors)
    if not is_choice(method, METHODS):
        raise InvalidOptionError(f"unknown merge method {method!r}; expected one of {METHODS}")
    if not posteriors:
        raise InvalidOptionError("merge needs at least one task posterior, got an empty list")
    held = ([base] if base is not None else []) + posteriors
    strangers = [type(p).__name__ for p in held if not isinstance(p, Posterior)]
    if strangers:
        raise IncompatiblePosteriorsError(f"pc.merge needs dual-form posteriors (from pc.fit or pc.dual_form); found "
                                          f"{strangers}")
    kinds = {_merge.dispatch(p.site_table_type) for p in held}
    if len(kinds) > 1:
        names = [type(p).__name__ for p in held]
        raise IncompatiblePosteriorsError(f"merging needs posteriors of one kind: all Gaussian dual-form posteriors "
                                          f"or all exponential-family products; found {names}"
                                          + (" (base first)" if base is not None else ""))
    return _merge(posteriors[0], base, posteriors, alphas, method, rule)


_merge = by_site_table("pc.merge", IncompatiblePosteriorsError)


@_merge.register(EFSiteTable)
def _merge_ef_posteriors(first, base, posteriors, alphas, method, rule) -> EFPosterior:
    return _merge_ef(base, posteriors, alphas, method, rule)


@_merge.register(Sites)
def _merge_gaussian(first, base, posteriors, alphas, method, rule) -> Posterior:
    posts, alphas = _check(base, posteriors, alphas, method)
    first = posts[0]
    family = first.family
    with jax.enable_x64(first.mean.dtype == jnp.float64):
        task_rows = [_task_rows(p, base) for p in posts]
        task_data = [_take(p.data, rows) for p, rows in zip(posts, task_rows)]
        if base is None:
            prior = gaussian_prior(first.spec, first.data)
            tau = first.state.precision if capability(family, FixedPrecision) else None
            base_nat = prior_natural(family, prior, tau)
            base_q = family.from_natural(base_nat)
            base_hessian = prior.precision
        else:
            base_nat, base_q = base.natural, base.state
            base_hessian = _loss_hessian(base, base.data, base.mean, True) if method == "hessian" else None
        pieces = ([base.data] if base is not None else []) + [t for t in task_data if t.per_example[0].shape[0]]
        data = pieces[0]
        for extra in pieces[1:]:
            data = concat_data(data, extra)
        q = _merged_state(family, base_q, base_nat, posts, alphas, method, task_data, base_hessian)
        if not bool(jnp.all(jnp.isfinite(q.mean))):

            raise NonFiniteResultError(f"the {method} merge produced a non-finite mean")
        family.check_positive_definite(q.precision, what=f"{method}-merged precision")
        spec = replace(first.spec, num_examples=int(data.per_example[0].shape[0]))
        post = build_posterior(spec, data, family, q, rule if rule is not None else first.rule, first.curvature,
                               first.storage, first.chunk_size, None, False, None, 0, False, True, cls=type(first),
                               operation="merge")
    return post.evolve(record=MergeInfo(method=method, alphas=tuple(alphas), num_tasks=len(posts),
                                        task_examples=tuple(int(r.size) for r in task_rows)))


def _merge_ef(base, posteriors, alphas, method, rule) -> EFPosterior:
    r"""Bayesian arithmetic of exponential-family posteriors:
    :math:`\lambda = \lambda_{pre} + \sum_k \alpha_k (\lambda_k - \lambda_{pre})`.

    The merged posterior stays in dual form with every site attributed: each task's own
    examples keep :math:`\alpha_k g_i`, an example of the base keeps its base site plus
    :math:`\sum_k \alpha_k (g_i^{(k)} - g_i^{pre})` (zero when the tasks froze the base, e.g. VCL
    updates or conjugate pairs), and so does the prior term; without a base the
    pre-posterior is the prior (:math:`\lambda_{pre} = -g_0`, no examples).
    """
    if method != "bayesian":
        raise InvalidOptionError(
            f"exponential-family posteriors merge by Bayesian arithmetic on their natural parameters (the family's "
            f"own merge, exact for conjugate pairs); method={method!r} is defined by Gaussian means, Hessians or "
            "precisions. Use method='bayesian'.")
    if rule is not None:
        raise InvalidOptionError("rule= applies to Gaussian posteriors; a merged EFPosterior keeps the first "
                                 "posterior's configuration")
    if not posteriors:
        raise InvalidOptionError("merge needs at least one task posterior, got an empty list")
    alphas = [1.0] * len(posteriors) if alphas is None else _weights(alphas)
    if len(alphas) != len(posteriors):
        raise InvalidOptionError(f"got {len(alphas)} alphas for {len(posteriors)} posteriors; expected one weight "
                                 "per posterior")
    _check_weights(alphas)
    first = posteriors[0]
    for k, post in enumerate(posteriors + ([base] if base is not None else [])):
        what = "base" if k == len(posteriors) else f"posterior {k}"
        _check_retained(post, what)
        if not k:
            continue
        if post.spec.model is not first.spec.model or post.family != first.family:
            raise IncompatiblePosteriorsError(f"{what} has another model or family than posterior 0; merging needs "
                                              "posteriors of one model and family")
        if post.conjugate_prior != first.conjugate_prior or (post.conjugate_prior and not bool(
                jnp.allclose(post.sites.prior, first.sites.prior, rtol=1e-12, atol=1e-12))):
            raise IncompatiblePosteriorsError(f"{what} has another prior than posterior 0")
        if post.config.design_key() != first.config.design_key():
            raise IncompatiblePosteriorsError(
                f"the sites of {what} were computed on another design ({post.config.design_key()}) than those of "
                f"posterior 0 ({first.config.design_key()}); refit one with the other's expectation=, num_nodes=, "
                "num_samples= and seed=")
    with jax.enable_x64(first.natural.dtype == jnp.float64):
        if base is None:
            pre_lam, pre_prior = -first.sites.prior, first.sites.prior
            pre_ids, pre_grads = jnp.zeros((0,), first.ids.dtype), first.sites.grads[:0]
        else:
            pre_lam, pre_prior, pre_ids, pre_grads = base.natural, base.sites.prior, base.ids, base.sites.grads
        held = np.asarray(pre_ids)
        inherited = set(base.tombstones) if base is not None else set()
        gone = set(inherited)  # ids deleted in the merged posterior's id space (each task's shifted with it)
        lam, prior, grads = pre_lam, pre_prior, pre_grads
        ids, data, renumbered = [pre_ids], base.data if base is not None else None, False
        task_grads = []
        for alpha, post in zip(alphas, posteriors):
            own = np.asarray(post.ids)
            missing = np.setdiff1d(held, own)
            if missing.size:
                raise IncompatiblePosteriorsError(f"a task posterior lacks base examples {missing[:10].tolist()}; "
                                                  "tasks must be obtained from the base (base.update(...))")
            mine = positions(own, held)
            if base is not None:
                stored = take_data(post.data, mine)
                if not all(np.array_equal(np.asarray(x), np.asarray(y))
                           for x, y in zip(stored.per_example, base.data.per_example)):
                    raise IncompatiblePosteriorsError(
                        "a task posterior holds other data than the base under the base's example ids; tasks must "
                        "be obtained from the base (base.update(...)), not fitted separately")
            grads = grads + alpha * (post.sites.grads[mine] - pre_grads)
            prior = prior + alpha * (post.sites.prior - pre_prior)
            lam = lam + alpha * (post.natural - pre_lam)
            new = np.flatnonzero(~np.isin(own, held))
            new_ids = np.asarray(post.ids[new])
            deleted = np.array(sorted(set(post.tombstones) - inherited), np.int64)  # this task's own deletions
            taken = np.concatenate([np.asarray(i) for i in ids] + [np.array(sorted(gone), np.int64)])
            mine_all = np.concatenate([new_ids, deleted])
            if np.intersect1d(taken, mine_all).size:  # tasks from one base count on from it alike
                shift = int(taken.max()) + 1 - int(mine_all.min())  # past every id held or deleted so far
                new_ids, deleted = new_ids + shift, deleted + shift
                renumbered = True
            gone.update(deleted.tolist())
            ids.append(jnp.asarray(new_ids, post.ids.dtype))
            task_grads.append(alpha * post.sites.grads[new])
            rows = take_data(post.data, new)
            data = rows if data is None else concat_data(data, rows)
        family = first.family
        if not bool(family.in_domain(lam)):
            raise OutOfDomainError(f"the merged natural parameter is outside the domain: {family.describe(lam)}")
        all_grads = jnp.concatenate([grads, *task_grads])
        inputs = [p for p in ([base] if base is not None else []) + list(posteriors)]
        scale = 1.0 + max(float(jnp.linalg.norm(p.natural)) for p in inputs)
        gap = float(jnp.linalg.norm(lam + prior + jnp.sum(all_grads, 0))) / scale
        allowed = 10.0 * (1.0 + sum(abs(a) for a in alphas)) * max(
            [default_tol(lam.dtype)] + [float(p.residual) for p in inputs])
        if not gap <= allowed:  # the inputs' own dual-form residuals, summed: a broken input shows here
            raise IncompatiblePosteriorsError(f"the merged sites do not sum to the merged natural parameters "
                                              f"(relative gap {gap:.1e}, allowed {allowed:.1e}); are the inputs "
                                              "converged posteriors?")
        ids = jnp.concatenate(ids)
        config = replace(first.config, spec=replace(first.config.spec, num_examples=int(ids.shape[0])))
        state = EFState(lam, EFSiteTable(all_grads, prior, ids))
    return first.evolve(config=config, data=data, state=state, tombstones=tuple(sorted(gone)),
                        record=MergeInfo(method="bayesian", alphas=tuple(alphas), num_tasks=len(posteriors),
                                         renumbered=renumbered))
