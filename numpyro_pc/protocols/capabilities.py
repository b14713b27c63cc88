r"""What a family can do beyond its core: capabilities that are looked up, not flags that are tested.

Every family implements the core of :class:`~numpyro_pc.protocols.family.GaussianFamily`
(natural and expectation parameters, densities, sites). What an *operation* needs beyond the
core is a property of the family's mathematics, and each such property is one capability
class here. A family declares the capabilities it has (its ``capabilities`` tuple) and, for
the ones it lacks that an operation may ask for, why (its ``lacks`` mapping, in mathematical
terms). Operations ask :func:`capability` (``None`` when absent: take another path) or
:func:`require` (a typed refusal that names the operation, what it needs and why the family
does not have it) — never which class a family or a posterior happens to be.

==========================  ======================================================================
capability                  meaning (paper sec. 2, Table 1)
==========================  ======================================================================
:class:`SiteSum`            the natural parameters are the prior site plus the sum of the example
                            sites in the family's own parameters, :math:`\lambda = \lambda_0 +
                            \sum_i \hat\lambda_i`: sites are added and removed by arithmetic
:class:`SiteDivision`       each site carries its share of the precision, so dividing sites out of
                            :math:`q` leaves a member of the family (a cavity)
:class:`FixedPrecision`     the precision is a fixed base measure (the isotropic family): only the
                            mean is learned and a site carries a gradient only
:class:`SiteCurvature`      what the family asks of each site's stored curvature, and the storage
                            ``storage="auto"`` picks
:class:`GaussianSolver`     how the Gaussian site solver treats the family's fixed point
==========================  ======================================================================

Adding a capability is one class here, one entry in the families that have it, and a call of
:func:`capability` or :func:`require` where an operation needs it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TypeVar

from numpyro_pc.errors import MissingCapabilityError

__all__ = ["SiteSum", "SiteDivision", "FixedPrecision", "SiteCurvature", "GaussianSolver", "capability", "require", "gaussian_solver", "site_curvature",
           "matrix_free_sites", "needs_dense_sum", "MATRIX_FREE_DIM",
           "capabilities_from_flags", "declares_flags", "flag_values", "flag_lacks", "refuse_unbridgeable_flags",
           "FLAG_NAMES"]

#: ``SiteCurvature.detail`` values (the same numbers as :data:`numpyro_pc.curvature.stores.FULL` …)
NO_CURVATURE, DIAGONAL_CURVATURE, FULL_CURVATURE = 0, 1, 2


@dataclass(frozen=True)
class SiteSum:
    """The natural parameters are ``λ = λ₀ + Σ_i λ̂_i`` in the family's own parameters."""

    needs = "the natural parameters to be the sum of the prior and example sites"
    remedy = "Fit with family='full', 'diagonal' or 'isotropic' for it."


@dataclass(frozen=True)
class SiteDivision:
    """Sites carry their share of the precision: ``q / exp(−ℓ̂_i)`` is a member of the family."""

    needs = "dividing sites out of q, which needs q to be the product of its sites"
    remedy = "Fit with family='full' or 'diagonal' for it."


@dataclass(frozen=True)
class FixedPrecision:
    """The precision is a fixed base measure ``τ I``; only the mean is learned."""

    needs = "a precision fixed by the prior"
    remedy = "Fit with family='isotropic' for it."


@dataclass(frozen=True)
class SiteCurvature:
    """What the family asks of a site's stored curvature.

    :param detail: 0 nothing (the sites carry gradients only), 1 diagonals, 2 matrices.
    :param default_storage: the curvature store ``storage="auto"`` picks; ``None``: the model
        decides (Gauss–Newton factors where the likelihood has them, else dense).
    :param matrix_free: the family asks of its sites only sums and matrix-free products, so
        ``storage="auto"`` keeps Jacobians by their nonzero columns (``"sparse"``) and a separable
        prior's curvature as its diagonal.
    """

    detail: int = FULL_CURVATURE
    default_storage: str | None = None
    matrix_free: bool = False

    needs = "sites that store a curvature"
    remedy = "Use a Gaussian family ('full', 'diagonal', 'isotropic', 'lowrank-r') for it."


@dataclass(frozen=True)
class GaussianSolver:
    """How the Gaussian site solver (:mod:`numpyro_pc.solvers.gaussian`) treats the family.

    :param dense_sum: the solver needs the dense curvature sum ``Σ Ĥ_i`` beside the family's own
        to precondition the mean (a Newton step on ``E_q[Σ ℓ_i]``, paper App. A.3); ``False`` for a
        family whose own precision is dense or that preconditions matrix-free.
    :param minimises_objective: the fixed point is a stationary point of the variational
        objective, so a step may be judged by the objective; ``False`` (a projected fixed point):
        by the dual-form residual alone.
    :param dense_checks: host-side checks may form the dense ``(d, d)`` precision (the float32
        representability check).
    """

    dense_sum: bool = True
    minimises_objective: bool = True
    dense_checks: bool = True

    needs = "the Gaussian site solver"
    remedy = "Use a Gaussian family ('full', 'diagonal', 'isotropic', 'lowrank-r') for it."


Kind = TypeVar("Kind")


def capability(family, kind: type[Kind]) -> Kind | None:
    """The family's capability of class ``kind``, or ``None`` when it does not have one.

    :param family: any family (a Gaussian family, an exponential-family product, a user's).
    :param kind: a capability class of this module.
    """
    for held in getattr(family, "capabilities", ()):
        if isinstance(held, kind):
            return held
    return None


def require(family, kind: type[Kind], operation: str, advice: str | None = None) -> Kind:
    """The family's capability of class ``kind``, or a refusal that says why in mathematical terms.

    :param operation: what the user asked for, as they would write it (``"pc.loo"``).
    :param advice: what to do instead; default: the families that have ``kind``.
    :raises MissingCapabilityError: the family lacks ``kind``; the message names ``operation``,
        what it needs and the family's reason.
    """
    held = capability(family, kind)
    if held is not None:
        return held
    why = getattr(family, "lacks", {}).get(kind, f"it declares no {kind.__name__} capability")
    name = getattr(family, "name", type(family).__name__)
    raise MissingCapabilityError(f"{operation} needs {kind.needs}; the {name} family lacks it: {why}. "
                                 f"{advice or kind.remedy}")


#: above this latent dimension a family whose own precision is not a matrix (diagonal, isotropic) keeps
#: its sites matrix-free too: Jacobian factors, a diagonal prior site, a Newton step by conjugate gradients
MATRIX_FREE_DIM = 2048


def matrix_free_sites(family, dim: int) -> bool:
    """Whether ``family``'s sites are kept matrix-free at ``dim`` latents: no ``(d, d)`` array anywhere.

    Always for a family that declares it (:class:`SiteCurvature` ``matrix_free``: the low-rank
    family); above :data:`MATRIX_FREE_DIM` for a family whose sites need less than a matrix
    (``detail`` below full: the diagonal and isotropic families, whose whole state is ``O(d)``).
    Below it those families keep their dense Newton step (exactly as before); the full family,
    whose precision is a ``(d, d)`` matrix, never.
    """
    needs = capability(family, SiteCurvature)
    if needs is None:
        return False
    return bool(needs.matrix_free or (needs.detail < FULL_CURVATURE and int(dim) > MATRIX_FREE_DIM))


def needs_dense_sum(family, dim: int) -> bool:
    """Whether the Gaussian solver preconditions the mean with the dense ``Σ Ĥ_i`` at ``dim`` latents
    (:class:`GaussianSolver` ``dense_sum``, unless the sites are matrix-free there: then the family's
    :meth:`newton_operator` by conjugate gradients)."""
    return gaussian_solver(family).dense_sum and not matrix_free_sites(family, dim)


def gaussian_solver(family) -> GaussianSolver:
    """The family's :class:`GaussianSolver` strategy.

    :raises MissingCapabilityError: the Gaussian site solver cannot treat the family.
    """
    return require(family, GaussianSolver, "the Gaussian site solver")


def site_curvature(family) -> SiteCurvature:
    """What the family asks of its sites' stored curvature (:class:`SiteCurvature`).

    :raises MissingCapabilityError: the family's sites store no Gaussian curvature.
    """
    return require(family, SiteCurvature, "computing Gaussian sites")


#: the class attributes families declared before capabilities
FLAG_NAMES = ("fixed_precision", "curvature_detail", "default_storage", "needs_dense_sum", "sparse_sites",
              "linear_precision", "minimises_objective", "dense_checks")


def flag_values(held: tuple) -> dict:
    """What the old family flags were for the capabilities ``held`` (the deprecated read-only flags)."""
    curvature = next((c for c in held if isinstance(c, SiteCurvature)), SiteCurvature(NO_CURVATURE, "none"))
    solver = next((c for c in held if isinstance(c, GaussianSolver)), GaussianSolver())
    return {"fixed_precision": any(isinstance(c, FixedPrecision) for c in held),
            "linear_precision": any(isinstance(c, SiteSum) for c in held),
            "curvature_detail": curvature.detail, "default_storage": curvature.default_storage,
            "sparse_sites": curvature.matrix_free, "needs_dense_sum": solver.dense_sum,
            "minimises_objective": solver.minimises_objective, "dense_checks": solver.dense_checks}


def declares_flags(cls) -> bool:
    """Whether ``cls`` itself declares one of the old flags as a plain class attribute."""
    return any(name in vars(cls) and not isinstance(vars(cls)[name], property) for name in FLAG_NAMES)


def flag_lacks(flags: dict) -> dict:
    """The reasons a family bridged from old flags lacks a capability, in the flags' own terms."""
    lacks = {FixedPrecision: "its precision is learned (fixed_precision = False)"}
    if not flags["linear_precision"]:
        lacks[SiteSum] = lacks[SiteDivision] = ("its precision is not the sum of its sites' precisions "
                                                "(linear_precision = False)")
    elif flags["fixed_precision"]:
        lacks[SiteDivision] = "its precision is fixed and its sites carry no curvature (fixed_precision = True)"
        del lacks[FixedPrecision]
    return lacks


def refuse_unbridgeable_flags(cls) -> None:
    """Refuse a family class that makes an old flag per-instance (a dataclass field or a property): the
    capabilities of a class cannot follow it.

    :raises TypeError: naming the flag and what to declare instead.
    """
    annotated = set(vars(cls).get("__annotations__", {}))
    for name in FLAG_NAMES:
        if name in annotated or isinstance(vars(cls).get(name), property):
            raise TypeError(f"{cls.__name__} makes the old family flag {name!r} a field or a property, which the "
                            "deprecation bridge cannot follow per instance; declare `capabilities = (...)` (and "
                            "`lacks`) with the classes of numpyro_pc.protocols.capabilities instead")


def capabilities_from_flags(cls, inherited: tuple) -> tuple:
    """The capabilities meant by a family class that still declares old flags (``fixed_precision``,
    ``linear_precision``, ``curvature_detail`` …) on top of the ``inherited`` ones, with a
    ``DeprecationWarning`` naming the replacement. A bridge for families that users registered
    before capabilities existed; it goes in the release after next."""
    flags = flag_values(inherited)
    for klass in reversed(cls.__mro__):
        flags.update({name: value for name, value in vars(klass).items()
                      if name in FLAG_NAMES and not isinstance(value, property)})
    warnings.warn(f"{cls.__name__} declares {sorted(n for n in FLAG_NAMES if n in vars(cls))}: family flags are "
                  "deprecated; declare `capabilities = (...)` with the classes of numpyro_pc.protocols.capabilities "
                  "(SiteSum, SiteDivision, FixedPrecision, SiteCurvature, GaussianSolver) instead",
                  DeprecationWarning, stacklevel=4)  # the user's class statement, through ABCMeta
    held = [SiteCurvature(flags["curvature_detail"], flags["default_storage"], flags["sparse_sites"]),
            GaussianSolver(flags["needs_dense_sum"], flags["minimises_objective"], flags["dense_checks"])]
    if flags["linear_precision"]:
        held.append(SiteSum())
    if flags["fixed_precision"]:
        held.append(FixedPrecision())
    elif flags["linear_precision"]:
        held.append(SiteDivision())
    if "lacks" not in vars(cls):
        cls.lacks = flag_lacks(flags)
    return tuple(held)
