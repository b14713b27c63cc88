r"""What a federated round reports: :class:`RoundInfo`, one entry of ``FederatedResult.history``.

Every path that runs rounds writes one: :func:`~numpyro_pc.federated.run` (Gaussian families),
:func:`~numpyro_pc.federated.ef.run_ef` (exponential-family products) and the servers of the
cross-process transports (:class:`~numpyro_pc.federated.server.ServerLogic`,
:class:`~numpyro_pc.federated.ef_transport.EFServerLogic`, :mod:`numpyro_pc.federated.flower`).
A :class:`RoundInfo` is a :class:`~numpyro_pc.protocols.records.Record`: its fields are attributes
(``info.kl_to_reference``) and, as before, keys of a read-only mapping
(``history[-1]["kl_to_reference"]``); a field that the path does not write, or that does not apply to the
run (no ``reference``, no ``privacy``), is ``None`` (and :meth:`RoundInfo.get` gives its default there,
as ``dict.get`` did). :func:`round_dicts` gives the plain dicts the history
held before the typed records (only the fields that apply), which the transports save as JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from numpyro_pc.protocols.records import Record, plain, record

__all__ = ["RoundInfo", "round_dicts"]


@record
class RoundInfo(Record):
    """One federated round (an entry of ``FederatedResult.history``, handed to ``callback``).

    :ivar int round: the round's number, from 1.
    :ivar float kl_to_previous: ``KL(q_t ‖ q_{t−1})`` between successive global posteriors (``nan``: the
        round failed).
    :ivar float residual: the local-correction residual, the largest ``‖λ_k − λ_jnt‖ / ‖λ_jnt‖`` over the
        round's clients (exponential families: ``/ (1 + ‖λ‖)``; ADMM: also the server's lag behind the
        sites' sum); ``None`` on a failed round of :func:`~numpyro_pc.federated.ef.run_ef`.
    :ivar float kl_rounding: exponential families: the KL's own float rounding error
        (:func:`~numpyro_pc.federated.ef.kl_rounding`); the stop rule compares with the larger of it and ``tol``.
    :ivar int participants: clients whose sites were aggregated this round.
    :ivar int local_iterations: the largest number of iterations of a local update.
    :ivar float local_residual: exponential families: the largest final residual of a local fixed point.
    :ivar int bytes_up: bytes the clients sent to the server this round (not the in-process
        exponential-family path).
    :ivar int bytes_down: bytes the server sent to the clients this round (likewise).
    :ivar int bytes: bytes sent both ways so far (cumulative; retries included).
    :ivar float seconds: wall time since the first round started (cumulative; in-process runs).
    :ivar float rho_min: the smallest local weight ``ρ_k`` a client used (in-process runs).
    :ivar float rho_max: the largest one.
    :ivar float rho_floor: the floor ``ρ`` after the round's retries (doubled at each; in-process runs).
    :ivar int retries: failed attempts of this round repeated under the safeguard (in-process runs).
    :ivar float step: the damping ``β`` of the global step the line search accepted (``0``: none decreased the
        joint objective; :mod:`~numpyro_pc.federated.line_search`).
    :ivar float objective: the joint objective ``J`` at the round's global posterior (with the line search).
    :ivar float natural_residual: with the line search: the fixed-point residual of the global posterior itself,
        ``‖λ(q⁺) − λ(q)‖ / ‖λ(q)‖`` with ``q⁺`` the global posterior of every client's site at ``q`` (zero exactly
        at the joint posterior of the family). Recorded only; the stop rule reads ``residual``.
    :ivar int step_trials: candidates the clients evaluated this round (with the line search).
    :ivar str step_kind: which candidate the line search accepted: ``"anderson"``, ``"proposal"`` (the
        clients' local solves, damped by ``step``), ``"natural_gradient"`` (the fallback) or ``"none"``.
    :ivar int clipped: clients whose sites bounded aggregation tempered this round.
    :ivar list clipped_clients: which (their indices; on a transport, their ids).
    :ivar float domain_step: private exponential-family runs: how far a noised sum was pulled back into the
        domain (1: it was inside; :func:`~numpyro_pc.federated.ef_robust.retreat_ef`).
    :ivar float epsilon: private runs: the privacy loss spent so far
        (:meth:`~numpyro_pc.federated.privacy.GaussianMechanism.epsilon_after`).
    :ivar float kl_to_reference: with a ``reference``: ``KL(q_t ‖ reference)``.
    :ivar float error_to_reference: exponential families with a ``reference``: ``‖λ − λ_ref‖ / ‖λ_ref‖``.
    :ivar str failure: exponential families: why the round failed (the run then stops as ``"diverged"``).
    :ivar dict rejected: transports: the senders excluded this round, each with the reason.
    :ivar int dropped: Flower: clients that failed to reply this round.
    """

    round: int
    kl_to_previous: float | None = None
    residual: float | None = None
    kl_rounding: float | None = None
    participants: int | None = None
    local_iterations: int | None = None
    local_residual: float | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    rho_min: float | None = None
    rho_max: float | None = None
    rho_floor: float | None = None
    retries: int | None = None
    step: float | None = None
    objective: float | None = None
    natural_residual: float | None = None
    step_trials: int | None = None
    step_kind: str | None = None
    clipped: int | None = None
    clipped_clients: list | None = None
    domain_step: float | None = None
    epsilon: float | None = None
    kl_to_reference: float | None = None
    error_to_reference: float | None = None
    failure: str | None = None
    rejected: Mapping[str, str] | None = None
    dropped: int | None = None


def round_dicts(history: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rounds as plain, JSON-friendly dicts of the fields that apply (those not ``None``): the dicts
    ``history`` held before :class:`RoundInfo`, which the transports save."""
    return [{k: v for k, v in plain(h).items() if v is not None} for h in history]
