r"""Expectation rules for ``E_q[ℓ]``, ``E_q[∇ℓ]`` and ``E_q[∇²ℓ]`` under a Gaussian ``q``.

Three rules are available (docs/notation.md); a posterior uses one rule for its sites *and*
for its refinement, so the dual-form identities hold for that rule exactly:

``delta``
    evaluate at the mean ``m`` (the ERM / Laplace case);
``mc``
    average over ``num_samples`` reparameterised draws ``z_s = m + L⁻ᵀε_s`` with fixed
    noise ``ε_s`` (common random numbers, so the fixed point is deterministic), moment-matched
    by :func:`mc_noise`: antithetic pairs whose sample covariance is exactly ``I`` when
    ``num_samples ≥ 2d``, so expectations of quadratics are exact;
``gh``
    Gauss–Hermite quadrature over each example's low-dimensional *dependence subspace*.
    When ``ℓ_i`` depends on ``z`` only through ``u = P_i z`` with ``P_i`` an ``r × d``
    orthonormal basis that does not change with ``z`` (the span of the Jacobians of the
    example's distribution parameters ``θ_i(z)``), Bonnet's and Price's theorems give

    .. math::

        E_q[∇ℓ_i] = P_iᵀ E[∇_u φ_i], \qquad E_q[∇²ℓ_i] = P_iᵀ E[∇²_u φ_i] P_i,
        \qquad u \sim N(P_i m, P_i Σ P_iᵀ),

    an ``r``-dimensional integral computed by a tensor Gauss–Hermite rule — exact up to
    quadrature error, and stored exactly in the factorised form ``(P_i, E[∇²_u φ_i])``.
    A GLM (one affine parameter, ``θ_i = a_iᵀz + b_i``) is the case ``r = 1``,
    ``P_i ∝ a_iᵀ``; a regression with a learned noise scale has ``r = 2``; a
    non-centred hierarchical example (``μ + τ θ̃_j``) has ``r = 3``. The prior term uses
    per-coordinate quadrature when ``ℓ_0`` is separable, the closed form when it is
    quadratic, and otherwise a scrambled Sobol (quasi-Monte Carlo) rule of
    ``num_prior_points`` points (default 4,096) with the reparameterisation estimator of its
    curvature (a hierarchical prior: :mod:`numpyro_pc.sites.prior`). The rule's own error, as the
    KL of a fit to the same fit with 16,384 points (two scramblings each): 1,024 points 3–4e-3
    on eight schools (d = 10) and 0.9–1.2e-2 on a 10-group varying-slope regression (d = 25);
    4,096 points 2–3e-4 and 0.9–1.5e-3, for 7 % more time per site pass on a 40-group model.
``auto``
    the default: ``gh`` where the model has a constant dependence subspace of dimension
    at most :data:`MAX_SUBSPACE_DIM`, else ``mc`` — whose error is then estimated at the
    fixed point and reported (:func:`numpyro_pc.posterior.fit` records it). When the
    subspace is constant but larger (``r`` up to :data:`MAX_MC_SUBSPACE_DIM` and at most
    ``d/2``: a non-centred varying-intercept-and-slope example, ``r = 6``), ``mc`` takes its draws in the
    full space but its derivatives along ``P_i`` only: the identities above hold at every
    draw, so ``E_q[∇²ℓ_i] = P_iᵀ E[∇²_u φ_i] P_i`` costs ``r`` Hessian-vector products per draw
    instead of ``d`` and is stored factorised, ``O(N·r·d)`` numbers instead of ``N·d²``, with
    the same values as the dense rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import ExpectationRuleError, InvalidOptionError
from numpyro_pc.model import probes
from numpyro_pc.model.likelihood import ModelData, example_params, prior_loss
from numpyro_pc.model.rows import take_rows
from numpyro_pc.options import is_choice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["ExpectationRule", "get_rule", "hermite_nodes", "tensor_hermite_nodes", "mc_noise", "prepare_rule",
           "dependence_subspace_dim", "subspace_basis", "subspace_excess", "subspace_tolerance", "MAX_SUBSPACE_DIM", "MAX_MC_SUBSPACE_DIM",
           "prior_is_separable", "prior_structure"]

_KINDS = ("delta", "mc", "gh", "auto")
MAX_SUBSPACE_DIM = 3  # tensor Gauss–Hermite beyond this many dimensions costs more than it saves
MAX_MC_SUBSPACE_DIM = 32  # largest dependence subspace the Monte Carlo rule differentiates along (and r ≤ d/2)
_NODE_BUDGET = 400  # quadrature points per example for a subspace of dimension >= 2


@dataclass(frozen=True)
class ExpectationRule:
    """Configuration of an expectation rule.

    :param str kind: ``"delta"``, ``"mc"`` or ``"gh"``.
    :param int num_samples: Monte Carlo draws for ``"mc"``.
    :param int seed: seed of the fixed Monte Carlo noise.
    :param int num_nodes: Gauss–Hermite nodes for ``"gh"``.
    :param int subspace_dim: ``r``, the dimension of each example's dependence subspace the rule
        integrates over (``"gh"``) or differentiates along (``"mc"``); ``0``: none (a scalar GLM for
        ``"gh"``, dense Hessians for ``"mc"``). Set by :func:`prepare_rule` for ``"auto"``.
    :param str prior_mode: how ``"gh"`` treats ``ℓ_0`` (``"separable"`` or
        ``"quadratic"``); set by :func:`prepare_rule`.
    :param str mc_precision: how ``"mc"`` estimates a site's precision for the full family
        with dense per-example storage. ``"reparam"``: the exact derivative of the
        fixed-draw expectation, ``Ĥ_i = 2 ∂E_K[ℓ_i]/∂Σ`` through the draws
        ``z_s = m + L⁻ᵀε_s`` (gradients only, no Hessians), so the fixed point is a
        stationary point of the fixed-draw objective and the solver's descent test agrees
        with its residual. ``"hessian"`` (default): the average of ``∇²ℓ_i`` at the draws (Price's
        estimator), which equals that derivative only in expectation — on a non-log-concave
        model (a Bayesian neural network) its fixed point and the objective's minimum differ
        by the Monte Carlo error and the solver stalls between them. Other storages use
        ``"hessian"``.
    """

    kind: str = "delta"
    num_samples: int = 64
    seed: int = 0
    num_nodes: int = 64
    prior_mode: str | None = None
    subspace_dim: int = 0
    num_prior_points: int = 4096
    mc_precision: str = "hessian"

    def __post_init__(self) -> None:
        if not is_choice(self.kind, _KINDS):
            raise InvalidOptionError(f"unknown expectation rule {self.kind!r}; expected one of {_KINDS}")
        if self.mc_precision not in ("reparam", "hessian"):
            raise InvalidOptionError(f"unknown mc_precision {self.mc_precision!r}; expected 'reparam' or 'hessian'")
        if self.kind == "mc" and self.num_samples < 1:
            raise InvalidOptionError(f"num_samples must be positive, got {self.num_samples}")
        if self.kind == "gh" and self.num_nodes < 2:
            raise InvalidOptionError(f"num_nodes must be at least 2, got {self.num_nodes}")

    @property
    def nodes_per_dim(self) -> int:
        """Gauss–Hermite nodes per dimension of the dependence subspace."""
        if self.subspace_dim <= 1:
            return self.num_nodes
        return max(3, min(self.num_nodes, int(_NODE_BUDGET ** (1.0 / self.subspace_dim))))


def get_rule(rule, **options) -> ExpectationRule:
    """Normalise a rule given as a name or an :class:`ExpectationRule`."""
    if isinstance(rule, ExpectationRule):
        return replace(rule, **options) if options else rule
    return ExpectationRule(kind=rule, **options)


def mc_noise(rule, dim, dtype) -> jax.Array:
    r"""The fixed standard-normal noise ``ε_1 … ε_K`` of the ``"mc"`` rule, moment-matched.

    The draws come in antithetic pairs ``±u_k`` (a zero draw completes an odd ``K``), so
    their sample mean is exactly ``0``; when ``K ≥ 2d`` the ``u_k`` are also whitened, so
    that ``(1/K) Σ_k ε_k ε_kᵀ = I`` exactly. Expectations of quadratics are then exact,
    and the fixed-draw variational objective ``E_K[ℓ(m + Cε)] − H(q)`` has the same
    second-order behaviour as the true one. With plain i.i.d. draws and ``K ≈ d`` the
    sample covariance has eigenvalues spread over ``(1 ± √(d/K))²`` (Marchenko–Pastur):
    the fixed-draw objective then inflates the posterior's variance in some directions by
    orders of magnitude, and its stationary point and the Hessian-average fixed point
    disagree by far more than the Monte Carlo error of either.

    :param ExpectationRule rule: the rule (``num_samples`` and ``seed`` are used).
    :param int dim: ``d``, the number of latent coordinates.
    :param dtype: floating dtype of the noise.
    :return: array of shape ``(K, d)``; a constant of the compiled program.
    """
    num = int(rule.num_samples)
    half = num // 2
    u = jax.random.normal(jax.random.PRNGKey(rule.seed), (half, dim), dtype)
    if half >= dim:
        gram = u.T @ u / (0.5 * num)
        u = jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(gram), u.T, lower=True).T
    parts = [u, -u] + ([jnp.zeros((1, dim), dtype)] if num % 2 else [])
    return jnp.concatenate(parts)


def hermite_nodes(num_nodes, dtype) -> tuple[jax.Array, jax.Array]:
    """Nodes and weights of ``E_{ξ~N(0,1)}[f(ξ)] ≈ Σ_k w_k f(ξ_k)`` (probabilists' Hermite)."""
    x, w = np.polynomial.hermite_e.hermegauss(num_nodes)
    return jnp.asarray(x, dtype), jnp.asarray(w / np.sqrt(2.0 * np.pi), dtype)


def tensor_hermite_nodes(num_nodes, dim, dtype) -> tuple[jax.Array, jax.Array]:
    """Tensor-product rule for ``E_{ξ~N(0, I_dim)}[f(ξ)]``: nodes ``(num_nodes**dim, dim)`` and weights."""
    x, w = np.polynomial.hermite_e.hermegauss(num_nodes)
    grids = np.meshgrid(*([x] * dim), indexing="ij")
    weights = np.prod(np.meshgrid(*([w / np.sqrt(2.0 * np.pi)] * dim), indexing="ij"), axis=0)
    nodes = np.stack([g.ravel() for g in grids], 1)
    return jnp.asarray(nodes, dtype), jnp.asarray(weights.ravel(), dtype)


def _probe_offsets(dim, count, dtype, seed=5) -> np.ndarray:
    """Fixed offsets around the mean at which the parameter Jacobians span the dependence subspace."""
    noise = 0.5 * probes.normal(seed, (count - 1, dim), dtype)
    return np.concatenate([np.zeros((1, dim), noise.dtype), noise], 0)


def _unit_rows(jac) -> jax.Array:
    norms = jnp.linalg.norm(jac, axis=-1, keepdims=True)
    return jac / jnp.where(norms > 0, norms, 1.0)


def subspace_basis(spec, mean, example, shared, dim, num_probes=None) -> jax.Array:
    """Orthonormal ``(dim, d)`` basis of the span of the example's parameter Jacobians near ``mean``.

    The rows of ``∂θ_i/∂z`` at ``num_probes`` fixed points around ``mean`` (default: 3 for the
    Gauss–Hermite subspaces, ``dim + 1`` beyond, so that one parameter whose Jacobian keeps a
    fixed direction, e.g. a global noise scale, still leaves enough rows to span the rest)
    are normalised and stacked; their top-``dim`` right singular vectors span the subspace
    ``ℓ_i`` depends on (an extra direction with singular value 0, for an example of lower
    rank, is harmless: ``ℓ_i`` does not vary along it).
    """
    theta = lambda z: example_params(spec, z, example, shared)[0]  # noqa: E731
    num_probes = (3 if dim <= MAX_SUBSPACE_DIM else dim + 1) if num_probes is None else num_probes
    offsets = _probe_offsets(mean.shape[0], num_probes, mean.dtype)
    jac_fn = jax.jacrev if spec.num_params < mean.shape[0] else jax.jacfwd
    jacs = jax.vmap(lambda o: jac_fn(theta)(mean + o))(offsets)  # (probes, k, d)
    stacked = _unit_rows(jnp.reshape(jacs, (-1, mean.shape[0])))
    _, _, vt = jnp.linalg.svd(stacked, full_matrices=False)
    return vt[:dim]


def subspace_excess(spec, mean, example, shared, basis, num_probes=2) -> jax.Array:
    """How far the example's parameter Jacobians leave the span of ``basis`` ``(r, d)`` at
    ``num_probes`` points around ``mean`` other than those :func:`subspace_basis` used: the
    largest norm of a normalised Jacobian row off the span. ``0`` (to rounding) when ``ℓ_i``
    depends on ``z`` only through ``basis``; of order one when the example depends on more
    directions than the rule's subspace, whose Hessians would then miss some.
    """
    theta = lambda z: example_params(spec, z, example, shared)[0]  # noqa: E731
    offsets = _probe_offsets(mean.shape[0], num_probes + 1, mean.dtype, seed=13)[1:]
    jac_fn = jax.jacrev if spec.num_params < mean.shape[0] else jax.jacfwd
    rows = _unit_rows(jnp.reshape(jax.vmap(lambda o: jac_fn(theta)(mean + o))(offsets), (-1, mean.shape[0])))
    return jnp.max(jnp.linalg.norm(rows - (rows @ basis.T) @ basis, axis=1))


def subspace_tolerance(dtype) -> float:
    """Largest :func:`subspace_excess` taken as rounding (also the span check of :func:`dependence_subspace_dim`)."""
    return 1e-6 if dtype == jnp.float64 else 1e-3


def dependence_subspace_dim(spec, data, z, num_rows=8, max_dim=MAX_SUBSPACE_DIM) -> int | None:
    """Dimension ``r`` of the constant subspace each example's loss depends on, or ``None``.

    Measured on ``num_rows`` examples spread over the data: the rank of the stacked parameter
    Jacobians at ``max(3, max_dim + 1)`` points around ``z``, verified at two further points
    (their rows must lie in the span to 1e-6). ``None`` when the span changes with ``z``
    (e.g. a neural network) or has more dimensions than those points can span, or when the
    model has no ``z``-dependent distribution parameter. Examples outside the probe rows are
    checked where their sites are computed (:func:`subspace_excess`).
    """
    if spec.num_params == 0:
        return None
    num = int(data.per_example[0].shape[0])
    rows = np.unique(np.linspace(0, num - 1, min(num_rows, num)).round().astype(np.int64))  # spread over the data
    examples = tuple(take_rows(x, rows) for x in data.per_example)
    spanning = max(3, max_dim + 1)
    offsets = _probe_offsets(z.shape[0], spanning + 2, z.dtype, seed=11)
    jacs = np.asarray(_probe_jacobians(replace(spec, num_examples=int(rows.size)), z, examples, data.shared, offsets))  # (rows, points, k, d)
    if not np.all(np.isfinite(jacs)):
        return None
    tol = 1e-7 if z.dtype == jnp.float64 else 1e-4
    off_span = subspace_tolerance(z.dtype)
    best = 0
    for per_row in jacs:
        span = np.asarray(_unit_rows(per_row[:spanning].reshape(-1, z.shape[0])))
        _, sv, vt = np.linalg.svd(span, full_matrices=False)
        if sv.max() <= 0:
            continue
        basis = vt[:int(np.sum(sv > tol * sv.max()))]
        check = np.asarray(_unit_rows(per_row[spanning:].reshape(-1, z.shape[0])))
        if np.max(np.linalg.norm(check - (check @ basis.T) @ basis, axis=1)) > off_span:
            return None
        best = max(best, basis.shape[0])
    return best or None


@partial(jax.jit, static_argnums=0)
def _probe_jacobians(spec, z, examples, shared, offsets) -> jax.Array:
    def one(ex) -> jax.Array:
        theta = lambda zz: example_params(spec, zz, ex, shared)[0]  # noqa: E731
        jac_fn = jax.jacrev if spec.num_params < z.shape[0] else jax.jacfwd
        return jax.vmap(lambda o: jac_fn(theta)(z + o))(offsets)

    return jax.vmap(one)(examples)


def prepare_rule(rule, spec, data, z) -> ExpectationRule:
    """Check that ``rule`` applies to the model and fill in what it needs.

    ``"auto"`` becomes ``"gh"`` (with the model's dependence-subspace dimension) where the
    model has a constant dependence subspace of dimension at most
    :data:`MAX_SUBSPACE_DIM`, else ``"mc"`` — differentiating along the subspace
    (``subspace_dim = r``) where it is constant with ``r ≤`` :data:`MAX_MC_SUBSPACE_DIM` and
    ``r ≤ d/2``. An explicit ``"mc"`` is kept as given (dense per-example Hessians unless
    ``subspace_dim`` is set).

    :raises ExpectationRuleError: ``"gh"`` on a model whose examples do not depend on
        ``z`` through a constant subspace of dimension at most :data:`MAX_SUBSPACE_DIM`;
        ``"mc"`` with a ``subspace_dim`` smaller than the model's dependence subspace.
    """
    if rule.kind == "mc" and rule.subspace_dim:
        largest = min(MAX_MC_SUBSPACE_DIM, z.shape[0])
        if not 0 < rule.subspace_dim <= largest:
            raise InvalidOptionError(f"subspace_dim={rule.subspace_dim} for expectation='mc' must lie in 1..{largest} "
                                     f"(at most {MAX_MC_SUBSPACE_DIM} and the latent dimension {z.shape[0]})")
        dim = dependence_subspace_dim(spec, data, z, max_dim=rule.subspace_dim)
        if dim is None or dim > rule.subspace_dim:
            found = ("no fixed subspace of that many dimensions (or no z-dependent distribution parameter)"
                     if dim is None else f"a {dim}-dimensional subspace")
            raise ExpectationRuleError(
                f"expectation='mc' with subspace_dim={rule.subspace_dim} differentiates each example's likelihood "
                f"along a fixed subspace of that dimension; this model's examples depend on {found}, so the "
                "Hessians would miss directions. Leave subspace_dim at 0 (dense Hessians) or use expectation='auto'.")
        return rule
    if rule.kind not in ("gh", "auto"):
        return rule
    scalar_glm = spec.num_params == 1 and spec.affine
    dim = 1 if scalar_glm else dependence_subspace_dim(spec, data, z, max_dim=MAX_MC_SUBSPACE_DIM)
    if dim is None or dim > MAX_SUBSPACE_DIM:
        if rule.kind == "auto":
            along = dim is not None and dim <= min(MAX_MC_SUBSPACE_DIM, z.shape[0] // 2) \
                and rule.mc_precision == "hessian"
            return replace(rule, kind="mc", subspace_dim=int(dim) if along else 0)
        found = "a subspace that changes with z" if dim is None else f"a {dim}-dimensional subspace"
        raise ExpectationRuleError(
            "expectation='gh' needs each example's likelihood to depend on the latents through a fixed subspace "
            f"of at most {MAX_SUBSPACE_DIM} dimensions (a GLM, a regression with a learned scale, a hierarchical "
            f"example); this model's examples depend on {found}. Use expectation='mc' or 'delta'."
        )
    rule = replace(rule, kind="gh", subspace_dim=0 if scalar_glm else int(dim))
    return replace(rule, prior_mode=prior_structure(spec, data, z))


def prior_structure(spec, data, z) -> str:
    """``"separable"``, ``"quadratic"`` or ``"qmc"``: how ``gh`` integrates the prior term.

    ``"qmc"`` — a prior whose Hessian is neither diagonal nor constant — is the mark of a
    hierarchy (group effects whose prior depends on other latents), which :func:`numpyro_pc.fit`
    uses to decide whether the MAP is a trustworthy start.
    """
    z1 = z + 0.37 * probes.normal(3, z.shape, z.dtype)
    if prior_is_separable(spec, data, z, z1):
        return "separable"
    hv0, hv1 = _prior_hvps(replace(spec, num_examples=1), jnp.stack([z, z1]), _first(data), data.shared,
                           _probe_vectors(z.shape[0], z.dtype))
    if bool(jnp.allclose(hv0, hv1, rtol=1e-9, atol=1e-12)):
        return "quadratic"
    return "qmc"


_SPLITS = 24  # random coordinate splits of the separability probe (a coupled pair escapes with odds 2^-24)


def prior_is_separable(spec, data, z, z1=None) -> bool:
    r"""Whether the prior's Hessian is diagonal at ``z`` and ``z1`` — matrix-free, ``O(d)`` memory per product.

    For a random split ``A`` of the coordinates and ``v`` positive on ``A`` and zero off it,
    ``(H v)_i = Σ_{j∈A} H_ij v_j`` is exactly ``0`` for every ``i ∉ A`` when ``H`` is diagonal (a
    separable ``ℓ_0``: each gradient coordinate depends on its own latent only, so its
    tangent is ``0 · h_ii``). A non-zero ``H_ij`` shows in every split that puts ``i`` and
    ``j`` on different sides; both sides of :data:`_SPLITS` random splits are tried, so a
    coupled pair escapes with probability ``2^-24``. This replaces two dense ``(d, d)``
    prior Hessians (40 GB each at ``d = 100,000`` in float32).
    """
    if z1 is None:
        z1 = z + 0.37 * probes.normal(3, z.shape, z.dtype)
    dim = z.shape[0]
    side = probes.coin_flips(7, (_SPLITS, dim))
    weights = probes.uniform(8, (_SPLITS, dim), 0.5, 1.5, z.dtype)
    vectors = np.concatenate([np.where(side, weights, 0.0), np.where(side, 0.0, weights)])
    hv = _prior_hvps(replace(spec, num_examples=1), jnp.stack([z, z1]), _first(data), data.shared, vectors)
    off = jnp.where(jnp.concatenate([side, ~side])[None], 0.0, hv)
    return bool(jnp.all(off == 0))


def _first(data) -> tuple[Any, ...]:
    return tuple(take_rows(x, np.arange(1)) for x in data.per_example)


def _probe_vectors(dim, dtype, count=3) -> np.ndarray:
    return probes.normal(9, (count, dim), dtype)


@partial(jax.jit, static_argnums=0)
def _prior_hvps(spec, points, first, shared, vectors) -> jax.Array:
    """``H(z) v`` for every point and every vector: ``(points, vectors, d)``."""
    grad = jax.grad(lambda zz: prior_loss(spec, zz, ModelData(first, shared)))
    return jax.vmap(lambda z: jax.vmap(lambda v: jax.jvp(grad, (z,), (v,))[1])(vectors))(points)
