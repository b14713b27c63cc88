r"""The options of :func:`~numpyro_pc.federated.run` and :func:`~numpyro_pc.federated.ef.run_ef`, grouped by concern.

Each group is a frozen dataclass whose values are checked once, when it is built (a bad value raises
:class:`~numpyro_pc.errors.InvalidOptionError` naming the field); its ``repr`` prints every field, defaults
included. ``None`` means "the path's default", documented per field: the Gaussian path
(:func:`~numpyro_pc.federated.run`) and the exponential-family path (:func:`~numpyro_pc.federated.ef.run_ef`)
differ in some.

===============  =========================================================  ============================================
keyword          group                                                      fields
===============  =========================================================  ============================================
``local=``       :class:`LocalSolve`                                        ``iters``, ``tol``, ``expectation``,
                                                                            ``num_nodes``, ``num_samples``, ``draw_seed``
``stop=``        :class:`StopRule`                                          ``tol``, ``residual_tol``
``safeguard=``   :class:`Safeguard` (or a bool)                              ``enabled``, ``margin``, ``max_retries``
``robust=``      :class:`Robustness`                                        ``max_share``, ``max_shift``
``privacy=``     :class:`~numpyro_pc.federated.privacy.GaussianMechanism`   (unchanged)
===============  =========================================================  ============================================

The flat keywords these replace (``local_iters=``, ``tol=``, ``safeguard_margin=``, ``max_share=``, …;
:data:`MOVED`) still work for one release with a ``FutureWarning`` naming the new spelling; giving one
together with its group is an :class:`~numpyro_pc.errors.InvalidOptionError`. ``safeguard=`` keeps taking
``True``/``False``/``None`` (``Safeguard(enabled=...)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from numpyro_pc.deprecation import warn_renamed

from ..errors import InvalidOptionError
from ..options import MAX_SEED, check_count, check_finite, check_flag, check_name
from .robust import check_bounds

__all__ = ["LocalSolve", "StopRule", "Safeguard", "Robustness", "MOVED", "resolve_options"]


def _set(obj, **values) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSolve:
    """How each client solves its local problem (paper eq. ``local_update``): keyword ``local=``.

    :param int iters: iterations of a local update (Newton steps, or the exponential-family fixed point);
        default ``None``: 50 (Gaussian), 200 (exponential family).
    :param float tol: relative change that stops a local update; default ``None``: ``1e-12`` in float64,
        ``1e-6`` in float32.
    :param str expectation: the site rule; default ``None``: Gaussian families ``"gh"`` for a GLM (and not the
        isotropic family), else ``"delta"``; exponential families ``"auto"`` (as :func:`numpyro_pc.fit`).
    :param int num_nodes: Gauss–Hermite or cubature nodes; default ``None``: 64 (Gaussian, as
        :func:`numpyro_pc.fit`), 32 (exponential family).
    :param int num_samples: exponential families: Monte Carlo draws per expectation; default ``None``
        (the rule's own).
    :param int draw_seed: exponential families: seed of those draws; default ``0``.
    """

    iters: int | None = None
    tol: float | None = None
    expectation: str | None = None
    num_nodes: int | None = None
    num_samples: int | None = None
    draw_seed: int = 0

    def __post_init__(self):
        _set(self, iters=check_count(self.iters, "LocalSolve.iters"), tol=None if self.tol is None else check_finite(self.tol, "LocalSolve.tol", 0.0),
             expectation=check_name(self.expectation, "LocalSolve.expectation"),
             num_nodes=check_count(self.num_nodes, "LocalSolve.num_nodes"),
             num_samples=check_count(self.num_samples, "LocalSolve.num_samples"),
             draw_seed=check_count(self.draw_seed, "LocalSolve.draw_seed", minimum=0, allow_none=False,
                                   maximum=MAX_SEED))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopRule:
    """When a run has converged: keyword ``stop=``. The run stops at the first round whose
    ``KL(q_t ‖ q_{t−1})`` is within ``tol`` *and* whose residual is within ``residual_tol``, or after
    ``rounds`` (a keyword of its own: a private run's accounting depends on it).

    :param float tol: default ``None``: ``1e-14`` (Gaussian) or ``1e-16`` (exponential family) in float64,
        ``1e-8`` in float32; ``0`` runs every round. An exponential-family run also accepts a KL below its own
        float rounding (``history[t]["kl_rounding"]``).
    :param float residual_tol: default ``None``: ``1e-7`` (Gaussian) or ``1e-10`` (exponential family) in
        float64, ``1e-4`` / ``1e-5`` in float32.
    """

    tol: float | None = None
    residual_tol: float | None = None

    def __post_init__(self):
        _set(self, tol=None if self.tol is None else check_finite(self.tol, "StopRule.tol", 0.0),
             residual_tol=None if self.residual_tol is None else check_finite(self.residual_tol,
                                                                              "StopRule.residual_tol", 0.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Safeguard:
    """FedPC's and ADMM's control of the local weight ``ρ``: keyword ``safeguard=`` (which also takes
    ``True``, ``False`` or ``None``, as ``Safeguard(enabled=...)``).

    Each client uses ``ρ_k = max(ρ, (1 + margin) λ_max(P_jnt⁻¹ S_k))`` (exponential families: the smallest
    ``ρ_k ≥ ρ`` whose ρ-cavity lies inside the domain with the margin), and a round that fails is repeated
    with the floor ``ρ`` doubled. The fixed point does not depend on ``ρ``.

    :param bool enabled: default ``None``: on for ``"fedpc"`` and ``"admm"``, off for ``"pvi"`` and ``"ama"``.
    :param float margin: relative margin above the convexity (domain) bound; default ``0.3``.
    :param int max_retries: repetitions of a failed round with the floor doubled; default ``6`` (the Gaussian
        path retries only with the safeguard on; a private run never retries).
    :param bool line_search: damp each round's global step until the joint objective does not increase
        (:mod:`~numpyro_pc.federated.line_search`; Gaussian families, :func:`~numpyro_pc.federated.run` in one
        process). Default ``None``: on for ``"fedpc"`` with every client taking part, no privacy and no bounded
        aggregation; off for ``"pvi"`` (its fixed damping is the method), ``"ama"``, ``"admm"`` (whose server step
        also averages the local posteriors), with privacy (a client's reported values are not protected by the
        mechanism), with ``Robustness`` bounds (a tempered site breaks ``λ = λ_0 + Σ η``, so the bounded fixed
        point is not a stationary point of the objective), and with ``fraction < 1`` (every candidate is
        evaluated by every client). ``True`` is refused with ADMM, privacy and bounds; with ``fraction < 1`` it
        asks every client each round. Exponential-family runs and the Flower server take the plain step.
    """

    enabled: bool | None = None
    margin: float = 0.3
    max_retries: int = 6
    line_search: bool | None = None

    def __post_init__(self):
        _set(self, enabled=None if self.enabled is None else check_flag(self.enabled, "Safeguard.enabled"),
             margin=check_finite(self.margin, "Safeguard.margin", 0.0),
             max_retries=check_count(self.max_retries, "Safeguard.max_retries", minimum=0, allow_none=False),
             line_search=None if self.line_search is None else check_flag(self.line_search,
                                                                           "Safeguard.line_search"))

    def on(self, algorithm: str) -> bool:
        """Whether the safeguard is on for ``algorithm`` (``enabled``, or its default)."""
        return algorithm in ("fedpc", "admm") if self.enabled is None else self.enabled

    def searches(self, algorithm: str, private: bool, bounded: bool = False, partial: bool = False) -> bool:
        """Whether the global step is line-searched (``line_search``, or its default) for ``algorithm``.

        :param bool private: a privacy mechanism is on. :param bool bounded: ``Robustness`` bounds are on.
        :param bool partial: only a fraction of the clients takes part in each round.
        :raises InvalidOptionError: ``line_search=True`` with ADMM, privacy or bounds.
        """
        if self.line_search is None:
            return algorithm == "fedpc" and not (private or bounded or partial)
        if self.line_search and (algorithm == "admm" or private or bounded):
            raise InvalidOptionError("Safeguard(line_search=True) damps the global step by the clients' reported "
                                     "objective values: not with algorithm='admm' (its server step also averages the "
                                     "local posteriors), with privacy (the values are not released through the "
                                     "mechanism) nor with Robustness bounds (a tempered site moves the fixed point "
                                     f"off the objective's stationary point); got algorithm={algorithm!r}, privacy="
                                     f"{'on' if private else 'off'}, bounds={'on' if bounded else 'off'}")
        return self.line_search


@dataclasses.dataclass(frozen=True, kw_only=True)
class Robustness:
    """Bounded aggregation (:mod:`~numpyro_pc.federated.robust`): keyword ``robust=``. Off by default: an
    honest client holding more than the bounded share of the information is tempered too, and the fixed
    point then leaves the joint posterior. Not with ADMM.

    :param float max_share: one client's site may raise the global precision by at most the factor
        ``1 + max_share`` over the others' (exponential families: at most ``max_share`` times the others'
        together, in the Fisher metric); default ``None``: no bound.
    :param float max_shift: ``c``: one client is clipped to within ``c`` standard deviations of the others'
        posterior (or of the others' without one client, whichever is nearer), so that it moves the global
        mean by at most ``c (1 + 2γ)/(1 + γ)`` standard deviations of the others' posterior while the others are
        within the bounds among themselves, and cannot get them clipped (Gaussian full, diagonal and
        isotropic families; low rank is refused). Exponential families: ``KL(q ‖ q_{−k}) ≤ max_shift² / 2``
        against the others' posterior as sent. Default ``None``: no bound.
    """

    max_share: float | None = None
    max_shift: float | None = None

    def __post_init__(self):
        if self.max_share is not None or self.max_shift is not None:
            share, shift = check_bounds(self.max_share, self.max_shift)
            _set(self, max_share=None if self.max_share is None else share,
                 max_shift=None if self.max_shift is None else shift)

    @property
    def active(self) -> bool:
        """Whether any bound is set."""
        return self.max_share is not None or self.max_shift is not None


_GROUPS: dict[str, type] = {"local": LocalSolve, "stop": StopRule, "safeguard": Safeguard, "robust": Robustness}

#: the flat keywords that moved into a group: ``old keyword → (group keyword, field)``
MOVED: dict[str, tuple[str, str]] = {
    "local_iters": ("local", "iters"), "local_tol": ("local", "tol"), "expectation": ("local", "expectation"),
    "num_nodes": ("local", "num_nodes"), "num_samples": ("local", "num_samples"),
    "draw_seed": ("local", "draw_seed"), "tol": ("stop", "tol"), "residual_tol": ("stop", "residual_tol"),
    "safeguard_margin": ("safeguard", "margin"), "max_retries": ("safeguard", "max_retries"),
    "max_share": ("robust", "max_share"), "max_shift": ("robust", "max_shift"),
}


def resolve_options(caller: str, flat: dict[str, Any], local=None, stop=None, safeguard=None,
                    robust=None) -> tuple[LocalSolve, StopRule, Safeguard, Robustness]:
    """The four groups of a call, from the groups given and the deprecated flat keywords ``flat``.

    Each flat keyword warns (``FutureWarning`` at the user's line, :func:`~numpyro_pc.deprecation.warn_renamed`)
    and fills its field of a group built here.

    :raises TypeError: a keyword that is neither an option nor a moved one (as Python's own).
    :raises InvalidOptionError: a flat keyword together with its group, or a group of the wrong type.
    """
    given = dict(local=local, stop=stop, safeguard=safeguard, robust=robust)
    for name in flat:
        if name not in MOVED:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    moved: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group, field = MOVED[name]
        cls = _GROUPS[group]
        if isinstance(given[group], cls):
            raise InvalidOptionError(f"{caller}() got both {name}= and {group}={cls.__name__}(...); {name}= is "
                                     f"the old spelling of {group}={cls.__name__}({field}=...): give it there only")
        warn_renamed(f"{caller}({name}=...) is deprecated: use {group}={cls.__name__}({field}=...) (from "
                     f"numpyro_pc.federated.options); the flat keyword will be removed in the next release")
        moved.setdefault(group, {})[field] = value
    out = []
    for group, cls in _GROUPS.items():
        value = given[group]
        if isinstance(value, cls):
            out.append(value)
            continue
        fields = moved.get(group, {})
        if group == "safeguard" and (value is None or isinstance(value, (bool, np.bool_))):
            fields = dict(fields, enabled=value)
        elif value is not None:
            also = " (or True, False, None)" if group == "safeguard" else ""
            raise InvalidOptionError(f"{group} must be a {cls.__name__}{also}; got {value!r} "
                                     f"({type(value).__name__})")
        out.append(cls(**fields))
    return tuple(out)  # type: ignore[return-value]
