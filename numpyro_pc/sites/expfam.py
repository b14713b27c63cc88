r"""Sites of an exponential-family product posterior and the BLR fixed point over them (paper §2).

In a minimal exponential family the site of loss :math:`\ell_i` at :math:`q` is linear in
the sufficient statistics,

.. math::

    \hat\ell_i(x) = \langle T(x), g_i \rangle, \qquad g_i = \nabla_\mu E_q[\ell_i]
    = F(\lambda)^{-1} \nabla_\lambda E_q[\ell_i] = F^{-1}\,\mathrm{Cov}_q(T(x), \ell_i(x)),

and the posterior is :math:`\lambda = -\sum_{i=0}^N g_i` (:math:`i = 0` the prior term
:math:`\ell_0 = -\log p_0`, so a prior of the family itself gives :math:`\lambda_0 = -g_0`).

**Estimator.** :math:`g_i` is computed as the weighted least-squares regression of
:math:`\ell_i` on :math:`(1, T(x))` over one set of points :math:`x_s` with probability
weights :math:`w_s` that stands for :math:`q` (Salimans & Knowles, 2013, "fixed-form VB by
linear regression"): :math:`g_i = \hat F^{-1} \widehat{\mathrm{Cov}}(T, \ell_i)` with *both*
moments taken under the same discrete measure. When :math:`\ell_i` is linear in
:math:`T` — every conjugate pair — the regression is exact whatever the points, so the
conjugate sites are exact to rounding; otherwise it converges to the true natural
gradient as the rule is refined. The points (:meth:`numpyro_pc.families.product.ProductFamily.design`)
are

* ``"quadrature"``: the tensor product of the factors' rules (Gauss–Jacobi for Beta,
  generalised Gauss–Laguerre for Gamma, Gauss–Hermite for Normal, enumeration for discrete
  sites; :mod:`numpyro_pc.families.point_sets`), deterministic; available when every latent site is a
  scalar continuous or a discrete site;
* ``"cubature"``: that grid for the sites that have a rule times the ``2D + 1`` points of the
  degree-3 symmetric cubature over the Gaussian blocks (:func:`numpyro_pc.families.point_sets.symmetric_cubature`),
  when every site without a rule is a Gaussian block: Bonnet's and Price's expectations are
  exact for losses of degree at most 3 in the blocks, with ``2D + 1`` points instead of draws;
* ``"mixed"``: that grid for the sites that have a rule times ``num_samples`` fixed draws
  shared by the others (vector sites; moment-matched for Gaussian factors);
* ``"mc"``: ``num_samples`` draws of every factor with a fixed seed, so the fixed point is
  deterministic.

The regression residual says how far :math:`\ell_i` is from linear in :math:`T` over the
points; a prior with (relative) residual below ``1e-9`` (float64) is conjugate-form and its
site is kept as the constant :math:`\lambda_0`.

Losses are evaluated with the model binding of :mod:`numpyro_pc.model.likelihood` at the
unconstrained image of each point (discrete values substituted as they are); for the
factors that live on constrained values the prior term drops the Jacobian
(:math:`\ell_0^{x}(x) = \ell_0(z) + \log|\det J_T(z)|`), Gaussian factors keep it (they
are densities of the unconstrained value).

**The fixed point.** The BLR (paper §2; Khan & Rue, 2023) with step :math:`\rho` iterates

.. math::

    \lambda \leftarrow (1-\rho)\,\lambda + \rho\,\tau(\lambda), \qquad
    \tau(\lambda) = c - \sum_{i \in A} g_i(\lambda),

where :math:`g_i = \nabla_\mu E_q[\ell_i]` are the sites of the *active* terms (recomputed
at every iterate), and :math:`c` collects what is held fixed: :math:`\lambda_0` of a
conjugate-form prior and the frozen sites of terms that are not corrected (the VCL update
freezes the past; site removal subtracts sites). A non-conjugate prior is one more active
term. At the fixed point :math:`\lambda = \tau(\lambda)`, which is the dual form
(eq. ``qdualform``) and the stationarity condition of the ELBO in the family.

The plain iteration converges linearly; Anderson mixing over the last few iterates
(:func:`blr_solve`, ``memory``) accelerates it. Safeguards: the step is halved until
every shape parameter of the new iterate is positive (the domain is convex, so this terminates when :math:`\lambda` is inside); the
step is halved for the following iterations when the residual exceeds the largest of the
last three; the residual
:math:`\|\lambda - \tau(\lambda)\| / (1 + \|\tau(\lambda)\|)` must be finite to count as
converged. Conjugate models converge in one full step (:math:`\tau` is constant).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.families.product import ProductFamily
from numpyro_pc.model.likelihood import ModelSpec, example_loss, prior_loss
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["EFConfig", "EFSites", "design", "model_point", "point_losses", "regress", "compute_sites", "prior_form_residual", "conjugate_rtol"]


def conjugate_rtol(dtype) -> float:
    """Regression residual below which a loss counts as linear in ``T``: 1e-9 (float64), 1e-4 (float32)."""
    return 1e-9 if jnp.finfo(dtype).bits == 64 else 1e-4


@dataclass(frozen=True)
class EFConfig:
    """Static configuration of the site computation.

    :ivar spec: the :class:`~numpyro_pc.model.likelihood.ModelSpec`.
    :ivar family: the :class:`~numpyro_pc.families.product.ProductFamily` (trace order).
    :ivar rule: ``"quadrature"``, ``"cubature"``, ``"mixed"`` or ``"mc"``.
    :ivar num_nodes: Gauss nodes per site (``"quadrature"``, ``"cubature"``, ``"mixed"``).
    :ivar num_samples: draws (``"mc"``, ``"mixed"``; under ``"cubature"`` those of the prior's
        conjugate-form test and of predictive densities).
    :ivar seed: seed of the fixed draws.
    """

    spec: ModelSpec
    family: ProductFamily
    rule: str = "quadrature"
    num_nodes: int = 32
    num_samples: int = 2048
    seed: int = 0

    @classmethod
    def make(cls, spec, family, expectation="auto", num_nodes=32, num_samples=None, seed=0, max_points=4096,
             max_mixed_points=1024) -> EFConfig:
        """Choose the rule. ``"auto"``: quadrature when every site has a rule and the tensor
        grid has at most ``max_points`` points (nodes per continuous site reduced to fit, down
        to 4); else, when every other site is a Gaussian block, the grid times the ``2D + 1``
        points of the symmetric cubature over the blocks (``"cubature"``), and otherwise the
        grid times ``num_samples`` draws (``"mixed"``), each when it fits in
        ``max_mixed_points``; else Monte Carlo. ``num_samples`` defaults to 2048 draws for
        Monte Carlo and 64 for the mixed design (its draws stand for vector sites only;
        Gaussian blocks are exact for quadratic losses with any number of moment-matched draws);
        under ``"cubature"`` the draws are those of the conjugate-form test of the prior term
        only (the cubature's ``2D + 1`` points cannot tell a quadratic prior from another), at least
        64 and four per natural parameter of the blocks.

        :raises InvalidOptionError: an unknown ``expectation``; ``"quadrature"`` for a family
            without a rule for every site; ``"cubature"`` for a family whose sites without a
            rule are not all Gaussian blocks; fewer draws than four per natural parameter
            integrated by draws (a Gaussian block's regression needs them).
        """
        if expectation not in ("auto", "quadrature", "mixed", "cubature", "mc"):
            raise InvalidOptionError(f"expectation for exponential-family products must be 'auto', 'quadrature', "
                                     f"'mixed', 'cubature' or 'mc'; got {expectation!r}")
        if expectation == "mixed" and (family.has_rule() or not any(f.has_rule for f in family.factors)):
            raise InvalidOptionError("'mixed' needs some sites with a rule (scalar or discrete) and some without")
        if expectation == "cubature" and (family.has_rule() or not family.admits_cubature()):
            raise InvalidOptionError("'cubature' needs Gaussian vector blocks and a Gauss rule for every other site "
                                     f"(the family has {[f.family_name for f in family.factors]}); use 'mixed' or "
                                     "'mc'")
        if expectation == "quadrature" and not family.has_rule():
            raise InvalidOptionError("quadrature needs every latent site to be a scalar continuous site or a discrete "
                                     "site; use 'mc'")
        choice = None
        some_rules = any(f.has_rule for f in family.factors)
        cubature = expectation == "cubature" or (
            expectation == "auto" and some_rules and not family.has_rule() and family.admits_cubature())
        if expectation != "mc" and (some_rules or cubature):
            mixed = not family.has_rule()
            drawn_default = max(64, 4 * family.drawn_size()) if cubature else 64
            num_samples = int(num_samples if num_samples is not None else drawn_default if mixed else 2048)
            points = family.cubature_size() if cubature else num_samples if mixed else 1
            rule = "cubature" if cubature else "mixed" if mixed else "quadrature"
            cap = max_points if points == 1 else max_mixed_points
            nodes = int(num_nodes)
            while family.grid_size(nodes) * points > cap and nodes > 4:
                nodes -= 1
            if family.grid_size(nodes) * points <= cap:
                choice = cls(spec, family, rule, nodes, num_samples, int(seed))
            elif expectation in ("quadrature", "mixed", "cubature"):
                raise InvalidOptionError(f"a tensor Gauss rule over {len(family.factors)} sites exceeds {cap} points; "
                                         "use 'mc'")
        if choice is None:
            num_samples = int(num_samples if num_samples is not None else 2048)
            choice = cls(spec, family, "mc", int(num_nodes), num_samples, int(seed))
        needed = family.drawn_size(choice.rule != "mc")
        num_samples = choice.num_samples
        if needed and num_samples < 4 * needed:
            what = ("the draws of the prior's conjugate-form test and of predictive densities" if choice.rule == "cubature"
                    else "their regression")
            raise InvalidOptionError(f"{needed} natural parameters are integrated by draws; num_samples={num_samples} "
                                     f"must be at least {4 * needed} for {what} (pass num_samples=)")
        return choice

    def design_key(self) -> dict:
        """What fixes the points of the site computation (posteriors merge only on equal keys)."""
        return {"rule": self.rule, "num_nodes": int(self.num_nodes), "num_samples": int(self.num_samples),
                "seed": int(self.seed)}

    def draws_nodes(self, max_points=1024) -> int:
        """Gauss nodes per site of the draws design (``design(..., cubature=False)``) of a
        ``"cubature"`` configuration: its own nodes, reduced (down to 4) until the grid times
        ``num_samples`` draws has at most ``max_points`` points, as ``"mixed"`` would choose."""
        nodes = int(self.num_nodes)
        while self.family.grid_size(nodes) * self.num_samples > max_points and nodes > 4:
            nodes -= 1
        return nodes


class EFSites(NamedTuple):
    """Sites at one ``λ``: ``grads[i] = ∇_μ E_q[ℓ_i]`` ``(N, P)``, the prior term's ``prior (P,)``,
    the regression residuals (relative RMS) of the examples ``(N,)`` and of the prior term on all
    statistics (``inf`` under ``"cubature"``, whose points cannot tell: see :func:`prior_form_residual`)."""

    grads: jax.Array
    prior: jax.Array
    residual: jax.Array
    prior_residual: jax.Array


def design(config, lam, seed=None, cubature=None) -> tuple[dict, jax.Array]:
    """Points standing for ``q``: ``(values dict (S, ...), weights (S,))`` in the factors' coordinates.

    :param seed: the draws' seed, or the cubature's rotation (an integer or a traced integer
        array, so that a check with another seed reuses the compiled program); default ``config.seed``.
    :param cubature: ``None``: as the rule says; ``False``: draws for the Gaussian blocks even
        under ``"cubature"`` (what a predictive density, which is no low-degree polynomial, and
        the prior's conjugate-form test are computed with).
    """
    seed = config.seed if seed is None else seed
    cubature = config.rule == "cubature" if cubature is None else cubature
    nodes = config.draws_nodes() if config.rule == "cubature" and not cubature else config.num_nodes
    return config.family.design(lam, nodes, config.num_samples, seed, use_rules=config.rule != "mc",
                                cubature=cubature)


def model_point(spec, family, point) -> tuple[jax.Array, dict[Any, Any], Any]:
    """The model binding's arguments at one design point: ``(z, discrete values, log-det)``,
    where the log-det is that of the factors living on constrained values (added back to the
    prior term)."""
    parts, log_det = [], 0.0
    for name, transform, ushape in zip(spec.latent.names, spec.latent.transforms, spec.latent.unconstrained_shapes):
        factor, x = family.factor(name), point[name]
        if factor.space == "unconstrained":
            u = jnp.reshape(x, ushape)
        else:
            u = transform.inv(x)
            log_det = log_det + jnp.sum(transform.log_abs_det_jacobian(u, x))
        parts.append(jnp.reshape(u, (-1,)))
    z = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.result_type(float))
    return z, {name: point[name] for name in spec.latent.discrete_names}, log_det


def _losses_at(spec, family, point, data) -> jax.Array:
    """``(ℓ_1, …, ℓ_N, -log p_0)`` at one design point ``(N+1,)``."""
    z, discrete, log_det = model_point(spec, family, point)
    per = jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared, discrete))(data.per_example)
    return jnp.concatenate([per, (prior_loss(spec, z, data, discrete) + log_det)[None]])


def _prior_at(spec, family, point, data) -> jax.Array:
    """The prior term ``-log p_0`` at one design point (the log-det added back, as in :func:`_losses_at`)."""
    z, discrete, log_det = model_point(spec, family, point)
    return prior_loss(spec, z, data, discrete) + log_det


def point_losses(spec, family, values, data) -> tuple[Any, Any]:
    """``(ℓ_i(x_s))`` ``(N, S)`` and the prior term ``-log p_0(x_s)`` ``(S,)`` at the points."""
    out = jax.vmap(lambda point: _losses_at(spec, family, point, data))(values)
    return out[:, :-1].T, out[:, -1]


def gaussian_moments(spec, family, lam, values, weights, data, stein=False) -> dict[str, tuple[jax.Array, jax.Array]]:
    r"""For each Gaussian factor, :math:`E[\nabla_u \ell_i]` ``(N+1, d)`` and
    :math:`E[\nabla^2_u \ell_i]` ``(N+1, d, d)`` over the points (row ``N``: the prior term),
    derivatives with respect to the factor's own unconstrained coordinates.

    With ``stein``, the expected Hessian is Stein's :math:`E[\nabla\ell\,(S(u - m))^\top]`
    (symmetrised) from the gradients alone — ``d`` forward passes over all examples at once
    instead of ``d`` forward-over-reverse passes per example; over a symmetric degree-3 rule it
    is exact for losses of degree at most 3 in the block (quadratic ones — the conjugate case —
    among them); over draws it is noisier than the Hessians, and over a rule shared by several
    blocks a loss bilinear in two of them is quartic jointly, so it is used with the cubature of
    one block only.

    Memory grows as points × examples × d², so Gaussian factors are meant for blocks of
    modest size (regression weights, a handful of scales); the Gaussian posteriors of
    :mod:`numpyro_pc.posterior` are the path for large ``d``.
    """
    gaussian = [f for f in family.factors if f.space == "unconstrained"]

    def at(point):
        def place(blocks) -> tuple[jax.Array, dict[Any, Any], Any]:
            return model_point(spec, family, {**point, **{f.site: b for f, b in zip(gaussian, blocks)}})

        def example(ex, blocks) -> jax.Array:
            z, discrete, _ = place(blocks)
            return example_loss(spec, z, ex, data.shared, discrete)

        def prior(blocks) -> jax.Array:
            z, discrete, log_det = place(blocks)
            return prior_loss(spec, z, data, discrete) + log_det

        blocks = [jnp.reshape(point[f.site], f.shape) for f in gaussian]
        if stein:  # forward mode over the block: d passes over all examples at once
            per_grad = jax.jacfwd(lambda b: jax.vmap(lambda ex: example(ex, b))(data.per_example))(blocks)
            pri_grad = jax.grad(prior)(blocks)
            return [jnp.concatenate([jnp.reshape(per_grad[k], (-1, f.dim)), jnp.reshape(pri_grad[k], (1, f.dim))])
                    for k, f in enumerate(gaussian)]
        # one scalar loss at a time: d forward-over-reverse passes each, not (N+1) reverse passes
        per_grad, per_hess = jax.vmap(lambda ex: (jax.grad(example, 1)(ex, blocks),
                                                  jax.hessian(example, 1)(ex, blocks)))(data.per_example)
        pri_grad, pri_hess = jax.grad(prior)(blocks), jax.hessian(prior)(blocks)
        out = []
        for k, f in enumerate(gaussian):
            grad = jnp.concatenate([jnp.reshape(per_grad[k], (-1, f.dim)), jnp.reshape(pri_grad[k], (1, f.dim))])
            hess = jnp.concatenate([jnp.reshape(per_hess[k][k], (-1, f.dim, f.dim)),
                                    jnp.reshape(pri_hess[k][k], (1, f.dim, f.dim))])
            out.append((grad, hess))
        return out

    moments = jax.vmap(at)(values)
    if stein:
        parts = dict(zip([f.site for f in family.factors], family.split(lam)))
        out = {}
        for f, g in zip(gaussian, moments):
            score = f.score(parts[f.site], values[f.site])
            hess = jnp.einsum("s,snd,se->nde", weights, g, score)
            out[f.site] = (jnp.einsum("s,snd->nd", weights, g), 0.5 * (hess + jnp.swapaxes(hess, -1, -2)))
        return out
    return {f.site: (jnp.einsum("s,snd->nd", weights, g), jnp.einsum("s,snde->nde", weights, h))
            for f, (g, h) in zip(gaussian, moments)}


def regress(stats, weights, targets) -> tuple[Any, jax.Array]:
    r"""Weighted least squares of each row of ``targets`` ``(M, S)`` on ``(1, T)``.

    Solved through the SVD of the weighted, centred and column-scaled design rather than the
    normal equations, whose condition number is the square of the design's: a concentrated
    posterior makes the statistics nearly collinear over the points (e.g. :math:`\log x` and
    :math:`x` for a Gamma with a large shape), so this matters at large ``N``.

    :return: ``(coefficients (M, P), relative RMS residual (M,))``; the coefficients are
        :math:`\hat F^{-1}\widehat{\mathrm{Cov}}(T, \ell)` under the weights.
    """
    tiny = jnp.finfo(stats.dtype).tiny
    mu = weights @ stats
    centred = stats - mu
    scale = jnp.sqrt(jnp.maximum(weights @ centred**2, tiny))
    root = jnp.sqrt(weights)[:, None]
    design = root * centred / scale
    mean = targets @ weights
    rhs = root * (targets.T - mean)
    u, sv, vt = jnp.linalg.svd(design, full_matrices=False)
    coef = (vt.T @ ((u.T @ rhs) / sv[:, None])).T / scale
    fitted = mean[:, None] + coef @ centred.T
    resid = jnp.sqrt(((targets - fitted) ** 2) @ weights)
    spread = jnp.sqrt(((targets - mean[:, None]) ** 2) @ weights) + jnp.abs(mean)
    return coef, resid / jnp.maximum(spread, tiny)


@partial(jax.jit, static_argnums=0)
def compute_sites(config, lam, data, seed=None) -> EFSites:
    r""":class:`EFSites` of every example and of the prior term at ``lam``.

    Factors on constrained values and discrete factors: the regression of the losses on their
    statistics. Gaussian factors: Bonnet's and Price's theorems,
    :math:`g = (E[\nabla\ell] - E[\nabla^2\ell]\,m,\ \tfrac12 E[\nabla^2\ell])` in the factor's
    natural coordinates (:meth:`numpyro_pc.families.expfam_gaussian.NormalFactor.site_from_moments`), exact
    for a loss quadratic in the block whatever the points as long as they reproduce the mean —
    which a regression on the block's own statistics is not when the loss couples its elements;
    under ``"cubature"`` of one block the expected Hessian is Stein's form from gradients
    (:func:`gaussian_moments`).
    The prior term counts as conjugate-form when it is linear in *all* statistics (one more
    regression on the full design, for its residual only; :func:`prior_form_residual`). ``seed``
    overrides the draws' seed (see :func:`design`).
    """
    family = config.family
    values, weights = design(config, lam, seed)
    per, prior = point_losses(config.spec, family, values, data)
    targets = jnp.concatenate([per, prior[None]], 0)
    regressed = [f for f in family.factors if f.space != "unconstrained"]
    num = targets.shape[0]
    blocks, resid = {}, jnp.zeros((num,), lam.dtype)
    if regressed:
        stats = jnp.concatenate([f.stats(values[f.site]) for f in regressed], -1)
        coef, resid = regress(stats, weights, targets)
        pos = 0
        for f in regressed:
            blocks[f.site] = coef[:, pos:pos + f.size]
            pos += f.size
    prior_resid = resid[-1]
    if len(regressed) < len(family.factors):
        cubature = config.rule == "cubature"
        stein = cubature and family.cubature_blocks() == 1
        moments = gaussian_moments(config.spec, family, lam, values, weights, data, stein=stein)
        for f, part in zip(family.factors, family.split(lam)):
            if f.space == "unconstrained":
                blocks[f.site] = f.site_from_moments(part, *moments[f.site])
        if cubature:
            prior_resid = jnp.asarray(jnp.inf, lam.dtype)
        else:
            _, full_resid = regress(family.stats(values), weights, prior[None])
            prior_resid = full_resid[0]
    grads = jnp.concatenate([blocks[f.site] for f in family.factors], -1)
    return EFSites(grads[:-1], grads[-1], resid[:-1], prior_resid)


def prior_form_residual(config, lam, data, sites) -> float:
    r"""Relative residual of the regression of the prior term on *all* the family's statistics:
    below :func:`conjugate_rtol`, the prior is conjugate-form (linear in ``T``) and its site
    is the constant :math:`\lambda_0`. ``sites`` (:class:`EFSites` at ``lam``) carry it, except
    under ``"cubature"``, whose ``2D + 1`` points cannot tell a quadratic prior from another: then it
    is computed with draws for the Gaussian blocks (the prior term alone, once; nodes as
    :meth:`EFConfig.draws_nodes`)."""
    if config.rule != "cubature":
        return float(sites.prior_residual)
    return float(_drawn_prior_residual(config, lam, data))


@partial(jax.jit, static_argnums=0)
def _drawn_prior_residual(config, lam, data) -> jax.Array:
    values, weights = design(config, lam, cubature=False)
    prior = jax.vmap(lambda point: _prior_at(config.spec, config.family, point, data))(values)
    _, resid = regress(config.family.stats(values), weights, prior[None])
    return resid[0]
