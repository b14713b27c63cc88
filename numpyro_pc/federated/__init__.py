"""Federated posterior correction (paper §3.4; docs/federated.md).

:func:`run` runs FedPC, PVI, AMA or ADMM over client shards in one process (clients
``vmap``-ed); :mod:`numpyro_pc.federated.flower` runs the same algorithm across processes
or machines with Flower (optional extra ``numpyro-pc[federated]``, imported lazily);
:class:`GaussianMechanism` makes the clients' sites differentially private.
"""

from .algorithms import ALGORITHMS, FederatedResult, run
from .core import ClientStack, LocalConfig, bind_clients, global_state, local_update
from .privacy import GaussianMechanism

__all__ = ["ALGORITHMS", "FederatedResult", "run", "ClientStack", "LocalConfig", "bind_clients", "global_state",
           "local_update", "GaussianMechanism"]
