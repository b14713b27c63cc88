"""Federated posterior correction (paper §3.4; docs/federated.md).

:func:`run` runs FedPC, PVI, AMA or ADMM over client shards in one process (clients
``vmap``-ed); :mod:`numpyro_pc.federated.flower` runs the same algorithm across processes
or machines with Flower (optional extra ``numpyro-pc[federated]``, imported lazily);
:class:`GaussianMechanism` makes the clients' sites differentially private;
:mod:`numpyro_pc.federated.ef` runs exponential-family product posteriors with FedPC, PVI or ADMM
(:func:`run_ef`, or :func:`run` with a dict ``family``; AMA needs a precision fixed by the prior and
refuses them). Their options come in groups (:mod:`numpyro_pc.federated.options`: :class:`LocalSolve`,
:class:`StopRule`, :class:`Safeguard`, :class:`Robustness`), and each round's report is a
:class:`RoundInfo` (:mod:`numpyro_pc.federated.records`).
"""

from .algorithms import ALGORITHMS, FederatedResult, run
from .core import ClientStack, LocalConfig, bind_clients, global_state, local_update
from .ef import EFServerState, aggregate_ef, bind_ef_clients, init_ef, round_ef, run_ef
from .options import LocalSolve, Robustness, Safeguard, StopRule
from .privacy import GaussianMechanism
from .records import RoundInfo

__all__ = ["ALGORITHMS", "FederatedResult", "run", "ClientStack", "LocalConfig", "bind_clients", "global_state",
           "local_update", "GaussianMechanism", "EFServerState", "aggregate_ef", "bind_ef_clients", "init_ef",
           "round_ef", "run_ef", "LocalSolve", "StopRule", "Safeguard", "Robustness", "RoundInfo"]
