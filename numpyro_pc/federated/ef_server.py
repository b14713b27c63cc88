r"""The server's side of an exponential-family federated run (:mod:`numpyro_pc.federated.ef`): its
state (:class:`EFServerState`: the prior, the clients' sites as sent, and the global natural
parameters where they are not the sites' sum), the checks of each client's message
(:func:`validate_ef_message`, :func:`aggregate_ef`), and the global posterior after a round —
the sites' sum, bounded or pulled back into the domain (:func:`server_step_ef`), or ADMM's
consensus step (:func:`admm_server_ef`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ClientMessageError, OutOfDomainError
from .ef_robust import bound_sites_ef, retreat_ef

__all__ = ["EFServerState", "site_natural", "global_natural", "validate_ef_message", "aggregate_ef",
           "server_step_ef", "admm_server_ef"]


class EFServerState(NamedTuple):
    """What the server keeps: ``prior`` :math:`\\lambda_0` ``(P,)``, the client sites ``sites`` ``(K, P)`` (as the
    clients sent them) and the global ``joint`` :math:`\\lambda_{jnt}` ``(P,)`` where it is not the sites' sum:
    after an ADMM round, after bounded aggregation (:func:`~numpyro_pc.federated.ef_robust.bound_sites_ef`) or after a private round the server
    had to pull back into the domain (:func:`~numpyro_pc.federated.ef_robust.retreat_ef`); ``None``: the global posterior is
    :math:`\\lambda_0 + \\sum_k \\eta_k`, as in FedPC and PVI."""

    prior: jax.Array
    sites: jax.Array
    joint: jax.Array | None = None


def site_natural(state) -> jax.Array:
    """:math:`\\lambda_0 + \\sum_k \\eta_k` (eq. ``global_update``)."""
    return state.prior + jnp.sum(state.sites, 0)


def global_natural(state) -> jax.Array:
    """The global posterior's :math:`\\lambda`: ADMM's ``joint`` where the state has one, else
    :func:`site_natural`."""
    return site_natural(state) if state.joint is None else state.joint


def validate_ef_message(family, state, client, message, max_abs=1e12, domain=True) -> np.ndarray:
    """Check client ``client``'s message against the server's state (see the module docstring).

    :param bool domain: also ask that the global :math:`\\lambda` with this message stay in the domain (off for
        private messages: their noise may take the sum out, and :func:`~numpyro_pc.federated.ef_robust.retreat_ef` handles it).

    :return: the message as a NumPy array of the state's dtype.
    :raises ClientMessageError: naming the client, what was expected and what was found.
    """
    def bad(msg) -> ClientMessageError:
        return ClientMessageError(f"client {client}: {msg}; its message is rejected and its site left as it was",
                                  client=client)

    num, size = state.sites.shape
    if not (isinstance(client, (int, np.integer)) and 0 <= int(client) < num):
        raise bad(f"expected a client index in [0, {num})")
    arr = np.asarray(message)
    dtype = np.dtype(state.sites.dtype)
    if arr.dtype != dtype:
        raise bad(f"expected dtype {dtype}, found {arr.dtype}")
    if arr.shape != (size,):
        raise bad(f"expected a site of shape ({size},) (the family's natural parameters), found shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise bad(f"expected finite values, found NaN or infinite ones at {np.flatnonzero(~np.isfinite(arr)).tolist()}")
    if arr.size and np.max(np.abs(arr)) > max_abs:
        raise bad(f"expected values below {max_abs:g} in absolute value, found {np.max(np.abs(arr)):.3g}")
    lam = site_natural(state) - state.sites[int(client)] + arr
    if domain and not bool(family.in_domain(lam)):
        raise bad(f"expected the global posterior to stay inside the family's domain, found {family.describe(lam)}")
    return arr


def aggregate_ef(family, state, messages, strict=True, max_abs=1e12, domain=True) -> tuple[EFServerState, dict]:
    """The server's half of a round: check each message, store the accepted ones, form the new state.

    :param dict messages: ``{client index: site (P,)}``.
    :param bool strict: raise on the first bad message; otherwise leave that client's site as it was and
        report it.
    :param bool domain: the domain checks (each message's and the sum's); off for private messages, whose
        global posterior :func:`~numpyro_pc.federated.ef_robust.retreat_ef` keeps inside.
    :return: ``(new EFServerState, {client: reason} of the refused messages)``; an ADMM state keeps its
        ``joint`` until :func:`admm_server_ef` replaces it.
    :raises ClientMessageError: a bad message (``strict``).
    :raises OutOfDomainError: the accepted messages together leave the domain (nothing is stored).
    """
    good, rejected = {}, {}
    for client, message in messages.items():
        try:
            good[client] = validate_ef_message(family, state, client, message, max_abs, domain)
        except ClientMessageError as err:
            if strict:
                raise
            rejected[client] = str(err)
    sites = state.sites
    if good:
        idx = np.asarray(sorted(good), dtype=np.int64)
        sites = sites.at[idx].set(jnp.asarray(np.stack([good[int(k)] for k in idx])))
    new = state._replace(sites=sites)  # FedPC's global posterior: the sites' sum; ADMM's λ_jnt is carried
    lam = site_natural(new)
    if domain and not bool(family.in_domain(lam)):
        raise OutOfDomainError(f"the clients' sites together leave the family's domain ({family.describe(lam)}); "
                               "the state is unchanged (increase rho or damp the sites)")
    return new, rejected


def server_step_ef(family, state, lam_ref, bounds=None, private=False) -> tuple[EFServerState, dict]:
    """The server's global posterior after :func:`aggregate_ef` stored the sites: the sites' sum, bounded by
    :func:`~numpyro_pc.federated.ef_robust.bound_sites_ef` (``bounds``) and, for ``private`` messages, kept inside by :func:`~numpyro_pc.federated.ef_robust.retreat_ef`.

    :return: ``(state, info)``, ``state.joint`` the new global :math:`\\lambda` where it is not the sites' sum;
        ``info``: ``clipped`` (count), ``clipped_clients`` (indices) and, private, ``domain_step``.
    :raises OutOfDomainError: the bounded sum outside the domain (not private), or a shift bound measured from
        an others' posterior outside it.
    """
    lam, info = site_natural(state), dict(clipped=0, clipped_clients=[])
    if bounds is not None:
        lam, tempered, undefined = bound_sites_ef(family, state.prior, state.sites, lam_ref, bounds)
        bad = np.flatnonzero(np.asarray(undefined))
        if bad.size:
            raise OutOfDomainError(f"max_shift bounds KL(q ‖ q_-k) against the posterior of the other clients, "
                                   f"which lies outside the family's domain for clients {bad.tolist()}: the bound "
                                   "is not defined there (increase rho, or leave max_shift unset)")
        info.update(clipped=int(np.sum(tempered)), clipped_clients=np.flatnonzero(np.asarray(tempered)).tolist())
    if private:
        lam, t = retreat_ef(family, lam_ref, lam)
        info["domain_step"] = float(t)
    elif not bool(family.in_domain(lam)):
        raise OutOfDomainError(f"the bounded sum of the clients' sites leaves the family's domain "
                               f"({family.describe(lam)}); the state is unchanged (increase rho or damp the sites)")
    joint = None if info["clipped"] == 0 and info.get("domain_step", 1.0) == 1.0 else lam  # else: the sites' sum
    return state._replace(joint=joint), info


def admm_server_ef(family, state, local, alpha) -> EFServerState:
    """ADMM's server step (paper eq. ``admm``) in natural parameters, after :func:`aggregate_ef` stored the sites:

    .. math::
        \\lambda_{jnt} \\leftarrow \\alpha\\big(\\lambda_0 + \\textstyle\\sum_k \\eta_k\\big)
        + (1 - \\alpha)\\,\\tfrac1M \\textstyle\\sum_k \\lambda_k .

    :param state: the :class:`EFServerState` with the round's sites.
    :param local: the participants' local posteriors :math:`\\lambda_k` ``(M, P)``.
    :param float alpha: the step :math:`\\alpha > 0` (``1/(1 + ρM)`` in :func:`run_ef`).
    :return: ``state`` with ``joint`` the new :math:`\\lambda_{jnt}`.
    :raises ClientMessageError: local posteriors of the wrong shape or not finite.
    :raises OutOfDomainError: the combination leaves the family's domain (only an ``alpha`` above 1, an
        extrapolation, can take two points of the convex domain outside it); the state is unchanged.
    """
    local = jnp.asarray(local)
    size = state.prior.shape[0]
    if local.ndim != 2 or local.shape[1] != size:
        raise ClientMessageError(f"ADMM needs the local posteriors as an array of shape (M, {size}); found shape "
                                 f"{tuple(local.shape)}")
    bad = np.flatnonzero(~np.all(np.isfinite(np.asarray(local)), axis=1))
    if bad.size:
        raise ClientMessageError(f"ADMM needs finite local posteriors; rows {bad.tolist()} of the participants' "
                                 "local posteriors are not")
    fed, mean = site_natural(state), jnp.mean(local, 0)
    joint = alpha * fed + (1.0 - alpha) * mean
    if not bool(family.in_domain(joint)):
        raise OutOfDomainError(f"the ADMM combination α(λ_0 + Σ_k η_k) + (1 − α) mean_k λ_k with "
                               f"α={float(alpha):g} leaves the family's natural domain ({family.describe(joint)}): "
                               "the domain is convex, so this happens only when α > 1 extrapolates past the sites' "
                               "sum or a local posterior lies outside it; the state is unchanged (use α ≤ 1)")
    return state._replace(joint=joint)
