r"""Expectation rules for ``E_q[ℓ]``, ``E_q[∇ℓ]`` and ``E_q[∇²ℓ]`` under a Gaussian ``q``.

Three rules are available (DESIGN §2); a posterior uses one rule for its sites *and*
for its refinement, so the dual-form identities hold for that rule exactly:

``delta``
    evaluate at the mean ``m`` (the ERM / Laplace case);
``mc``
    average over ``num_samples`` reparameterised draws ``z_s = m + L⁻ᵀε_s`` with fixed
    noise ``ε_s`` (common random numbers, so the fixed point is deterministic);
``gh``
    Gauss–Hermite quadrature over each example's distribution parameter
    ``θ_i = a_iᵀz + b_i`` (one affine parameter per example: a GLM). By Bonnet's and
    Price's theorems ``E_q[∇ℓ_i] = a_i E[φ_i'(θ)]`` and ``E_q[∇²ℓ_i] = a_i a_iᵀ E[φ_i''(θ)]``
    with ``θ ~ N(a_iᵀm + b_i, a_iᵀΣa_i)`` — exact up to quadrature error. The prior term
    uses per-coordinate quadrature when ``ℓ_0`` is separable and the closed form when it
    is quadratic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ExpectationRuleError
from .likelihood import prior_loss

__all__ = ["ExpectationRule", "get_rule", "hermite_nodes", "prepare_rule"]

_KINDS = ("delta", "mc", "gh")


@dataclass(frozen=True)
class ExpectationRule:
    """Configuration of an expectation rule.

    :param str kind: ``"delta"``, ``"mc"`` or ``"gh"``.
    :param int num_samples: Monte Carlo draws for ``"mc"``.
    :param int seed: seed of the fixed Monte Carlo noise.
    :param int num_nodes: Gauss–Hermite nodes for ``"gh"``.
    :param str prior_mode: how ``"gh"`` treats ``ℓ_0`` (``"separable"`` or
        ``"quadratic"``); set by :func:`prepare_rule`.
    """

    kind: str = "delta"
    num_samples: int = 64
    seed: int = 0
    num_nodes: int = 64
    prior_mode: str | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown expectation rule {self.kind!r}; expected one of {_KINDS}")
        if self.kind == "mc" and self.num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {self.num_samples}")
        if self.kind == "gh" and self.num_nodes < 2:
            raise ValueError(f"num_nodes must be at least 2, got {self.num_nodes}")


def get_rule(rule, **options):
    """Normalise a rule given as a name or an :class:`ExpectationRule`."""
    if isinstance(rule, ExpectationRule):
        return replace(rule, **options) if options else rule
    return ExpectationRule(kind=rule, **options)


def hermite_nodes(num_nodes, dtype):
    """Nodes and weights of ``E_{ξ~N(0,1)}[f(ξ)] ≈ Σ_k w_k f(ξ_k)`` (probabilists' Hermite)."""
    x, w = np.polynomial.hermite_e.hermegauss(num_nodes)
    return jnp.asarray(x, dtype), jnp.asarray(w / np.sqrt(2.0 * np.pi), dtype)


def prepare_rule(rule, spec, data, z):
    """Check that ``rule`` applies to the model and fill in what it needs.

    :raises ExpectationRuleError: ``"gh"`` on a model whose examples do not depend on
        ``z`` through one affine parameter, or whose prior is neither separable nor
        quadratic.
    """
    if rule.kind != "gh":
        return rule
    if spec.num_params != 1 or not spec.affine:
        what = f"{spec.num_params} parameter(s)" + ("" if spec.affine else " that are not affine in z")
        raise ExpectationRuleError(
            "expectation='gh' needs each example's likelihood to depend on the latents through one "
            f"affine parameter (a GLM such as Bernoulli(logits=X @ w)); this model has {what} per example. "
            "Use expectation='mc' or 'delta'."
        )
    hess = jax.hessian(lambda zz: prior_loss(spec, zz, data))
    z1 = z + 0.37 * jax.random.normal(jax.random.PRNGKey(3), z.shape, z.dtype)
    h0, h1 = hess(z), hess(z1)
    off = lambda h: h - jnp.diag(jnp.diag(h))  # noqa: E731
    if bool(jnp.all(off(h0) == 0)) and bool(jnp.all(off(h1) == 0)):
        return replace(rule, prior_mode="separable")
    if bool(jnp.allclose(h0, h1, rtol=1e-9, atol=1e-12)):
        return replace(rule, prior_mode="quadratic")
    raise ExpectationRuleError(
        "expectation='gh' needs a prior term that factorises over the latent coordinates or is "
        "quadratic (Gaussian); this model's prior is neither (e.g. a hierarchical scale). "
        "Use expectation='mc' or 'delta'."
    )
