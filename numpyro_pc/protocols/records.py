r"""What an operation reports: typed records with documented fields that still read like dicts.

Every operation leaves its diagnostics on the posterior it returns (``post.record``), and a
solve leaves one entry per iterate (``post.history``). These are :class:`Record`\ s: frozen
dataclasses whose fields are documented and checked when built (a misspelt field is a
``TypeError``, not a silent extra key), read as attributes (``post.record.damping``) or, as
before, as a read-only mapping over *every* field (``post.record["damping"]``; a field that
does not apply to this call, or was not computed, is ``None``, and ``record.get(key, default)``
gives ``default`` there, as ``dict.get`` did for a key the old dicts left out). ``"key" in record``
is true for every field of the type; :meth:`Record.as_dict` gives plain dicts for JSON.

One record type per operation: :class:`FitInfo`, :class:`UpdateInfo`, :class:`DeleteInfo`,
:class:`RefineInfo`, :class:`MergeInfo`, :class:`LoadInfo`, :class:`FederatedInfo` (and :class:`ExportInfo` for a kernel's export); the solver's fields
(:class:`SolveFields`) are common to those that solve. Nested: :class:`StartInfo` (how the
solver's start was chosen), :class:`CorrectionMagnitude` (how far the corrected sites moved),
:class:`ExpectationError` (the fixed point seen through independent draws) and
:class:`IterationInfo` (one iterate of a solve).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Self, dataclass_transform

import numpy as np

__all__ = ["Record", "record", "IterationInfo", "SolveFields", "StartInfo", "CorrectionMagnitude", "ExpectationError",
           "FitInfo", "BoostInfo", "UpdateInfo", "DeleteInfo", "RefineInfo", "MergeInfo", "LoadInfo", "ExportInfo", "FederatedInfo", "plain"]


class Record(Mapping[str, Any]):
    """Base of the typed records: a frozen dataclass (declare subclasses with :func:`record`) that is
    also a read-only :class:`~collections.abc.Mapping` over its fields, in declaration order.

    Equality is the mapping's: a record equals a dict with the same items, every field included (those
    that do not apply are ``None``), so it does not equal the shorter dict an operation returned before
    the typed records. Iteration lists the record type's own fields first, then those it shares (e.g.
    :class:`SolveFields`). A record is read-only (no item assignment, ``update`` or ``copy``: build
    another with :meth:`replace`), unhashable like a dict, and not a ``dict`` for :func:`json.dumps`
    (:meth:`as_dict` or :func:`plain` gives one).
    """

    __slots__ = ()

    def _names(self) -> tuple[str, ...]:
        return _field_order(type(self))

    def __getitem__(self, key: str) -> Any:
        if key in self._names():
            return getattr(self, key)
        raise KeyError(f"{type(self).__name__} has no field {key!r}; its fields are {', '.join(self._names())}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key``, or ``default`` where it is ``None`` (does not apply) or is no field: as
        ``dict.get`` on the dicts these records replaced, which held only the keys that applied
        (``h.get("kl_to_reference", nan)`` is ``nan`` on a run without a reference)."""
        value = getattr(self, key) if key in self._names() else None
        return default if value is None else value

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (field names only: an unknown one is a ``TypeError``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain, JSON-friendly dict (nested records, tuples and NumPy scalars converted)."""
        return {name: plain(getattr(self, name)) for name in self._names()}

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names()
                          if getattr(self, name) is not None)
        return f"{type(self).__name__}({shown})"


@functools.cache
def _field_order(cls: type) -> tuple[str, ...]:
    """A record's fields, the class's own first (``operation`` leads), then those of its bases."""
    names = [f.name for f in dataclasses.fields(cls)]
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return tuple([n for n in names if n not in inherited] + [n for n in names if n in inherited])


@dataclass_transform(kw_only_default=True, frozen_default=True)
def record(cls: type) -> type:
    """Declare a :class:`Record` subclass: a frozen, keyword-only dataclass (mapping equality kept)."""
    return dataclasses.dataclass(frozen=True, eq=False, kw_only=True, repr=False)(cls)


def plain(value: Any) -> Any:
    """``value`` with records and mappings as dicts, tuples as lists, arrays (NumPy or JAX) as nested lists
    and NumPy scalars as Python numbers: what :func:`json.dumps` takes."""
    if isinstance(value, Record):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__array__") and hasattr(value, "shape"):
        return np.asarray(value).tolist()
    return value


@record
class IterationInfo(Record):
    """One iterate of a solve (an entry of ``post.history``; the start is entry 0).

    :ivar int iteration: the iterate's number (``0``: the start).
    :ivar float residual: the dual-form residual there (``nan`` where not computed).
    :ivar float residual_mean: its part from the gradient condition ``Σ ĝ_i = 0``.
    :ivar float residual_precision: its part from the precision condition ``S = Σ Ĥ_i``.
    :ivar float objective: the variational objective there (``None`` where not computed).
    :ivar float step: the step size taken to reach it (``0`` for the start).
    :ivar bool accelerated: whether an Anderson or Newton step produced it.
    :ivar float seconds: time since the solve started.
    :ivar int reused_sites: on the start of an update's solve: corrected sites taken from the batch
        before instead of recomputed.
    :ivar StartInfo restart: on the start of an update's solve: the cold start used after the warm
        one failed, and why.
    """

    iteration: int
    residual: float
    residual_mean: float | None = None
    residual_precision: float | None = None
    objective: float | None = None
    step: float | None = None
    accelerated: bool | None = None
    seconds: float | None = None
    reused_sites: int | None = None
    restart: StartInfo | None = None


@record
class StartInfo(Record):
    """How the solver's start was chosen (:func:`numpyro_pc.solvers.start.default_start`).

    :ivar str kind: ``"map"`` (MAP/Laplace), ``"elbo"`` (mean-field ELBO), ``"prior"``, ``"array"``
        or ``"guide"``.
    :ivar str reason: why this start was taken instead of the one asked for (``None``: it was asked for).
    :ivar int iterations: L-BFGS iterations of the MAP search.
    :ivar float grad_norm: the gradient's norm where it stopped.
    :ivar float value: the negative log joint there.
    :ivar bool converged: whether the MAP search converged.
    :ivar int saddle_escapes: saddle points left along negative curvature.
    :ivar dict candidates: the objective of each start compared (lower is better), when compared.
    """

    kind: str
    reason: str | None = None
    iterations: int | None = None
    grad_norm: float | None = None
    value: float | None = None
    converged: bool | None = None
    saddle_escapes: int | None = None
    candidates: Mapping[str, float] | None = None


@record
class CorrectionMagnitude(Record):
    """How far each corrected site moved in an update (:func:`numpyro_pc.ops.diagnostics.site_mismatch`).

    :ivar ids: the corrected examples' ids.
    :ivar magnitude: the mismatch of each one's stale site against its fresh one.
    :ivar float total: their sum.
    """

    ids: Any
    magnitude: Any
    total: float


@record
class ExpectationError(Record):
    """The fixed point's residual seen through an independent set of points: an estimate of how far
    the answer is from the family's true optimum when expectations are Monte Carlo or cubature.

    :ivar float independent_draws_residual: under independent Monte Carlo draws (seed + 1).
    :ivar int num_samples: draws per expectation.
    :ivar float rotated_cubature_residual: under a rotated cubature (``expectation="cubature"``).
    :ivar int num_points: cubature points.
    """

    independent_draws_residual: float | None = None
    num_samples: int | None = None
    rotated_cubature_residual: float | None = None
    num_points: int | None = None


@record
class SolveFields(Record):
    """The solver's report, common to every operation that solves for a fixed point.

    :ivar int iterations: iterations of the solve.
    :ivar float residual: the relative residual it stopped at (exponential-family solves; a Gaussian
        posterior's is :attr:`~numpyro_pc.protocols.posterior.Posterior.residual`).
    :ivar bool converged: whether it reached the tolerance.
    :ivar float rho: the last step size (exponential-family solves).
    :ivar float max_site_nonlinearity: the largest per-site nonlinearity of the last site pass
        (exponential-family solves).
    :ivar ExpectationError expectation_error: the Monte Carlo or cubature error estimate, when computed.
    :ivar int coarse_iterations: iterations of a first solve under a coarser design that gave the start
        (exponential-family products with Gaussian blocks: :func:`numpyro_pc.solvers.expfam.coarse_config`);
        ``iterations`` counts those of the configured design.
    """

    iterations: int | None = None
    residual: float | None = None
    converged: bool | None = None
    rho: float | None = None
    max_site_nonlinearity: float | None = None
    expectation_error: ExpectationError | None = None
    coarse_iterations: int | None = None

    def solve_fields(self) -> dict[str, Any]:
        """The :class:`SolveFields` part, to build another operation's record from this one's solve."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SolveFields)}


@record
class FitInfo(SolveFields):
    """What ``pc.fit`` / ``pc.dual_form`` did.

    :ivar str operation: ``"fit"``, ``"dual_form"`` or ``"read"`` (a guide read without refinement).
    :ivar StartInfo start: the solver's start and how it was chosen.
    :ivar dict boundary: what :func:`numpyro_pc.solvers.boundary.check_boundary` flagged
        (:meth:`~numpyro_pc.solvers.boundary.BoundaryCheck.as_record`), when it flagged or skipped.
    """

    operation: str = "fit"
    start: StartInfo | None = None
    boundary: Mapping[str, Any] | None = None


@record
class BoostInfo(SolveFields):
    """What ``pc.boost`` did: a fit started from a checkpoint (paper §4.2; :mod:`numpyro_pc.ops.boosting`).

    :ivar str operation: ``"boost"``.
    :ivar StartInfo start: ``kind`` ``"checkpoint"``, or the fit's own start (``reason`` says why) when
        the solve from the checkpoint failed.
    :ivar int mapped: latent coordinates whose start was taken from the checkpoint.
    :ivar int from_prior: latent coordinates started from the prior (a neighbouring model's new ones).
    :ivar bool precision_from_checkpoint: whether the start's precision on the mapped coordinates was the
        checkpoint's (not for a fixed-precision family).
    :ivar int checkpoint_examples: the checkpoint's sites (examples it summarised).
    :ivar float start_residual: the fit's dual-form residual at the start.
    :ivar float seconds: wall time.
    """

    operation: str = "boost"
    start: StartInfo | None = None
    mapped: int | None = None
    from_prior: int | None = None
    precision_from_checkpoint: bool | None = None
    checkpoint_examples: int | None = None
    start_residual: float | None = None
    seconds: float | None = None


@record
class UpdateInfo(SolveFields):
    """What an update did (paper §3.1; :meth:`numpyro_pc.posterior.DualPosterior.update`).

    :ivar str operation: ``"update"``.
    :ivar str correction: the correction policy.
    :ivar int corrected: past examples whose sites were recomputed.
    :ivar int new: examples added.
    :ivar float seconds: wall time.
    :ivar float kl_to_previous: ``KL(q_{t+1} ‖ q_t)``.
    :ivar float weight: the memory's scale (``"weighted"``; ``1`` otherwise).
    :ivar str fallback: why a weighted correction fell back to the unweighted memory (``None``: it did not).
    :ivar int past_examples_touched: past-example site evaluations the solve made.
    :ivar int reused_sites: corrected sites reused from the start instead of recomputed.
    :ivar StartInfo restart: the cold start taken after the warm start failed, and why.
    :ivar CorrectionMagnitude correction_magnitude: how far the corrected sites moved.
    :ivar float batch_fraction: the stochastic correction's block size.
    :ivar int epochs: the stochastic correction's passes.
    :ivar int memory: examples in the function-space memory after the update (``"kprior"``).
    :ivar float linearisation_error: what prediction matching did not re-express of the memory's old
        sites, relative to them (``"kprior"``; zero for a GLM, :mod:`numpyro_pc.ops.kprior`).
    """

    operation: str = "update"
    correction: str | None = None
    corrected: int | None = None
    new: int | None = None
    seconds: float | None = None
    kl_to_previous: float | None = None
    weight: float | None = None
    fallback: str | None = None
    past_examples_touched: int | None = None
    reused_sites: int | None = None
    restart: StartInfo | None = None
    correction_magnitude: CorrectionMagnitude | None = None
    batch_fraction: float | None = None
    epochs: int | None = None
    memory: int | None = None
    linearisation_error: float | None = None


@record
class DeleteInfo(SolveFields):
    """What a deletion did (paper §3.2; :mod:`numpyro_pc.ops.unlearning`).

    :ivar str operation: ``"delete"``.
    :ivar str method: the deletion method.
    :ivar int deleted: examples deleted.
    :ivar float damping: the fraction of the removal applied (``1``: all of it; below with ``damping=True``).
    :ivar float seconds: wall time.
    :ivar float kl_to_previous: ``KL(q_new ‖ q_old)``.
    """

    operation: str = "delete"
    method: str | None = None
    deleted: int | None = None
    damping: float | None = None
    seconds: float | None = None
    kl_to_previous: float | None = None


@record
class RefineInfo(SolveFields):
    """What :meth:`~numpyro_pc.protocols.posterior.Posterior.refine` did (``operation`` ``"refine"``)."""

    operation: str = "refine"


@record
class MergeInfo(SolveFields):
    """What a merge did (:func:`numpyro_pc.ops.merging.merge`; the solve's fields when it refined).

    :ivar str operation: ``"merge"``.
    :ivar str method: the merge method.
    :ivar tuple alphas: the weights of the merged posteriors.
    :ivar int num_tasks: posteriors merged.
    :ivar tuple task_examples: examples each brought.
    :ivar dict renumbered: ids shifted past earlier posteriors' (old id → new id), per posterior.
    """

    operation: str = "merge"
    method: str | None = None
    alphas: tuple | None = None
    num_tasks: int | None = None
    task_examples: tuple | None = None
    renumbered: Any = None


@record
class FederatedInfo(Record):
    """The global posterior of a federated run (:func:`numpyro_pc.federated.run`); the rounds' own
    records are ``FederatedResult.history``.

    :ivar str operation: ``"federated"``.
    :ivar str algorithm: ``"fedpc"``, ``"pvi"``, ``"admm"`` or ``"ama"``.
    :ivar float rho: the local weight ``ρ`` the run used.
    :ivar int rounds: rounds run.
    :ivar str status: ``"converged"``, ``"max_rounds"`` or ``"diverged"``.
    :ivar float admm_alpha: ADMM's relaxation, when run.
    """

    operation: str = "federated"
    algorithm: str | None = None
    rho: Any = None
    rounds: int | None = None
    status: str | None = None
    admm_alpha: float | None = None


@record
class ExportInfo(Record):
    """A posterior rebuilt from a pure kernel's state (:mod:`numpyro_pc.kernels`); ``operation`` names the kernel."""

    operation: str


@record
class LoadInfo(Record):
    """What loading a saved posterior found (``operation`` ``"load"``; ``residual``: recomputed from the arrays)."""

    operation: str = "load"
    residual: float | None = None
