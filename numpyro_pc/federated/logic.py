r"""The transport-free halves of a federated run across processes, for every family.

:class:`ClientLogic` is a Gaussian client, :class:`ClientByFamily` a client that becomes a
Gaussian or an exponential-family client (:class:`~numpyro_pc.federated.ef_transport.EFClientLogic`)
at the server's first message, and :func:`server_logic` the server for a run's ``family``
(:class:`~numpyro_pc.federated.server.ServerLogic` or
:class:`~numpyro_pc.federated.ef_transport.EFServerLogic`). The Flower apps
(:mod:`numpyro_pc.federated.flower`) drive them; so can tests and other transports.
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.families.registry import Gaussian, GaussianNatural
from numpyro_pc.ops.merging import gaussian_prior, prior_natural
from numpyro_pc.protocols.capabilities import FixedPrecision, capability

from ..errors import InvalidOptionError, PrivacyError
from .algorithms import check_settings
from .core import LocalConfig, bind_clients, global_state, local_update, release_site
from .ef_transport import EFClientLogic, EFServerLogic, is_ef_family, parse_family
from .privacy import check_gaussian_prior_data_free
from .server import ServerLogic

__all__ = ["ClientLogic", "ClientByFamily", "server_logic"]


def _nat(arrays) -> GaussianNatural:
    return GaussianNatural(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))


def _arrays(x) -> list[np.ndarray]:
    return [np.asarray(v) for v in x]


class ClientLogic:
    """What a client does each round, without any transport (stateful: it keeps ``η_k``).

    :param model: the NumPyro model.
    :param tuple args: the client's model arguments (its shard).
    :param dict kwargs: the model's keyword arguments.
    :param privacy: this client's own
        :class:`~numpyro_pc.federated.privacy.GaussianMechanism` (the server cannot switch it
        off): every site it sends is clipped and noised, and after ``privacy.releases``
        messages it refuses to send more (:class:`~numpyro_pc.errors.PrivacyError`).
    :param int seed: seed of the privacy noise (default: from the operating system).
    :ivar releases: messages sent so far.
    """

    kind = "gaussian"

    def __init__(self, model, args, kwargs=None, privacy=None, seed=None):
        self.spec, self.stack, (self.data,) = bind_clients(model, [args], kwargs)
        self.site = None
        self.privacy = privacy
        self.releases = 0
        self.seed = secrets.randbits(31) if seed is None else int(seed)
        self._fns = {}

    @property
    def num_examples(self) -> int:
        """Examples of this client's shard."""
        return int(self.stack.mask.sum())

    def state_arrays(self) -> list:
        """What a rebuilt client needs to go on (a Flower ``Context.state``): its site, releases and seed."""
        return _arrays(self.site) + [np.asarray([self.releases, self.seed])]

    def restore(self, arrays) -> None:
        """Take back :meth:`state_arrays`."""
        self.site, (self.releases, self.seed) = _nat(arrays[:2]), (int(v) for v in arrays[2])

    def _cfg(self, config) -> LocalConfig:
        n = self.num_examples
        if n < int(config.get("min_examples", 1)):
            raise PrivacyError(f"this client holds {n} example(s), fewer than the run's min_examples="
                             f"{config['min_examples']}: it does not take part (its site would reveal its data)")
        family, _, _, rule = check_settings(config["algorithm"], config["family"], None if config["algorithm"] == "pvi"
                                       else config["rho"], config["damping"],
                                       None if config["expectation"] == "auto" else config["expectation"], self.spec)
        if self.privacy is not None:
            if config["algorithm"] == "admm":
                raise PrivacyError("this client adds differential-privacy noise, which the run's algorithm 'admm' "
                                   "cannot take (it needs the exact local posterior): it does not take part")
            if self.releases >= self.privacy.releases:
                raise PrivacyError(f"this client's privacy budget covers {self.privacy.releases} message(s) "
                                   f"(ε={self.privacy.epsilon:g}, δ={self.privacy.delta:g}), all sent: it stops")
        return LocalConfig(self.spec, family, rule, int(config["num_nodes"]), int(config["local_iters"]),
                           float(config["local_tol"]), safeguard=bool(config.get("safeguard", False)),
                           margin=float(config.get("safeguard_margin", 0.3)), privacy=self.privacy)

    def _key(self) -> jax.Array:
        self.releases += 1
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), self.releases)

    def _ex(self) -> tuple[tuple[jax.Array, ...], jax.Array, tuple]:
        return tuple(x[0] for x in self.stack.per_example), self.stack.mask[0], self.stack.shared

    def initial(self, config) -> list:
        """Round 1: the prior ``(m_0, P_0)`` and this client's first site."""
        cfg = self._cfg(config)
        if self.privacy is not None:  # the prior leaves outside the mechanism: it must not hold the data
            check_gaussian_prior_data_free(self.spec, [self.data])
        prior = gaussian_prior(self.spec, self.data)
        tau = cfg.family.prior_tau(prior)
        q0 = global_state(cfg.family, prior, prior_natural(cfg.family, prior, tau),
                          jax.tree.map(jnp.zeros_like, prior_natural(cfg.family, prior, tau)))
        ex, mask, shared = self._ex()
        if capability(cfg.family, FixedPrecision):  # init="auto" of the in-process run: sites start at one
            self.site = GaussianNatural(jnp.zeros_like(q0.mean), jnp.zeros((), q0.mean.dtype))
        else:
            self.site = jax.jit(release_site, static_argnums=0)(cfg, q0, ex, mask, shared, self._key())
        return _arrays(self.site) + [np.asarray(prior.mean), np.asarray(prior.precision)]

    def update(self, arrays, config) -> tuple:
        """One local update from the global Gaussian ``arrays = [mean, precision]``."""
        cfg = self._cfg(config)
        q_jnt = Gaussian(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))
        if cfg not in self._fns:
            self._fns[cfg] = jax.jit(local_update, static_argnums=0)
        ex, mask, shared = self._ex()
        out = self._fns[cfg](cfg, q_jnt, self.site, jnp.asarray(config["rho"], q_jnt.mean.dtype), ex, mask, shared,
                             self._key())
        damping = float(config["damping"])
        self.site = jax.tree.map(lambda o, n: o + damping * (n - o), self.site, out.site)
        # a private client reports nothing beyond its (noised) message
        metrics = {} if self.privacy is not None else {"iterations": int(out.iterations), "ok": bool(out.ok)}
        return _arrays(self.site) + _arrays(out.local), metrics


class ClientByFamily:
    """A client that learns its kind from the server: at the first message it becomes a :class:`ClientLogic`
    (a Gaussian ``family`` in the server's config: ``"full"``, ``"diagonal"``, ``"isotropic"``) or an
    :class:`~numpyro_pc.federated.ef_transport.EFClientLogic` (a ``{latent site: family name}`` family). The
    arguments are :class:`ClientLogic`'s.

    :ivar logic: the client made at the first message (``None`` before).
    """

    def __init__(self, model, args, kwargs=None, privacy=None, seed=None):
        self.make = (model, args, kwargs, privacy, secrets.randbits(31) if seed is None else int(seed))
        self.logic = None

    def for_config(self, config) -> ClientLogic | EFClientLogic:
        """The client for the server's ``config``.

        :raises InvalidOptionError: a config whose family is of another kind than the first message's.
        """
        ef = is_ef_family(config["family"])
        if self.logic is None:
            self.logic = (EFClientLogic if ef else ClientLogic)(*self.make)
        elif ef != (self.logic.kind == "ef"):
            raise InvalidOptionError(f"the server's family {config['family']!r} is of another kind than the one "
                                     f"this client was started with ({self.logic.kind})")
        return self.logic


def server_logic(num_clients, algorithm="fedpc", family="full", **kwargs) -> ServerLogic | EFServerLogic:
    """The server's logic for ``family``: :class:`ServerLogic` for a Gaussian family's name,
    :class:`~numpyro_pc.federated.ef_transport.EFServerLogic` for a ``{latent site: family name}`` dict (or its
    text, ``"p=beta,r=gamma"`` or JSON); ``kwargs`` go to it (``None`` values are left out)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    family = parse_family(family)
    if isinstance(family, dict):
        return EFServerLogic(num_clients, family, algorithm, **kwargs)
    for key in ("private", "init", "num_samples", "draw_seed"):
        if kwargs.pop(key, None) not in (None, False, "zero", 0):
            raise InvalidOptionError(f"{key} is an option of exponential-family runs; family={family!r} is Gaussian")
    return ServerLogic(num_clients, algorithm, family, **kwargs)
