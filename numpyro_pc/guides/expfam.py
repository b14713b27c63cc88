"""Hand-written exponential-family guides ⇄ natural parameters of a product family.

A hand-written guide such as ::

    def guide(X, y=None):
        a = numpyro.param("a", 1.0, constraint=constraints.positive)
        b = numpyro.param("b", 1.0, constraint=constraints.positive)
        numpyro.sample("p", dist.Beta(a, b))

is read by tracing it with its parameters substituted: every sample site must be a
distribution of a registered factor (Beta, Gamma, Dirichlet, Normal/LogNormal,
MultivariateNormal, Bernoulli, Categorical: the factor of the latent site of the same
name, :func:`numpyro_pc.families.product.factor_from_distribution`) whose arguments are
``numpyro.param`` values themselves. An ``AutoGuideList`` of such guides and of
``AutoNormal`` parts is read the same way (AutoNormal's sites are Normals on the
unconstrained values, its ``*_auto_loc``/``*_auto_scale`` params feed them). Which param feeds which argument is found from the
Jacobian of the arguments with respect to the params (the identity for exactly one
param), so :func:`write_params` can map a posterior back to the guide's own names.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.infer.autoguide import AutoGuide, AutoGuideList

from numpyro_pc.errors import GuideParamsError, UnsupportedGuideError
from numpyro_pc.families.product import ProductFamily, factor_from_distribution, unwrap_distribution
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["GuideMap", "is_hand_written", "read_guide", "write_params"]


class GuideMap(NamedTuple):
    """How a hand-written guide's params describe a :class:`ProductFamily` member.

    :ivar family: the product family in the model's latent order.
    :ivar names: per factor, the param name feeding each distribution argument.
    :ivar params: the guide's param values that were read (others are passed through).
    """

    family: ProductFamily
    names: tuple
    params: dict


def is_hand_written(guide) -> bool:
    """Whether ``guide`` is read as an exponential-family product: a plain callable (not a
    NumPyro autoguide) or an ``AutoGuideList``."""
    return callable(guide) and (not isinstance(guide, AutoGuide) or isinstance(guide, AutoGuideList))


def _trace(guide, params, args, kwargs) -> dict[str, Any]:
    fn = handlers.seed(guide, 0)
    if params is not None:
        fn = handlers.substitute(fn, data=params)
    with handlers.block():
        return handlers.trace(fn).get_trace(*args, **kwargs)


def read_guide(guide, params, latent_names, args=(), kwargs=None, supports=None) -> tuple[GuideMap, jax.Array]:
    """Read the guide as ``(GuideMap, natural parameter)``.

    :param params: the guide's params (constrained values, e.g. ``svi.get_params``), or
        ``None`` for the guide's initial values.
    :param latent_names: the model's latent sites in the posterior's order.
    :param dict supports: the model's support of each latent site (``None``: real).
    :raises UnsupportedGuideError: a sample site of no registered factor, or guide
        sites that differ from the model's latent sites.
    :raises GuideParamsError: a distribution argument that is not one ``numpyro.param``.
    """
    kwargs = dict(kwargs or {})
    try:
        trace = _trace(guide, params, args, kwargs)
    except Exception as err:  # the user's guide failed: say with what
        raise GuideParamsError(f"the guide raised {type(err).__name__}: {err} when run with the given params") from err
    samples = {n: s for n, s in trace.items()
               if s["type"] == "sample" and not s["is_observed"] and not s["infer"].get("is_auxiliary")}
    if set(samples) != set(latent_names):
        raise UnsupportedGuideError(f"the guide's sample sites {sorted(samples)} differ from the model's latent sites "
                                    f"{sorted(latent_names)}; a mean-field guide needs one site per latent")
    supports = supports or {}
    read = {n: factor_from_distribution(n, samples[n]["fn"], supports.get(n)) for n in latent_names}
    values = {n: s["value"] for n, s in trace.items() if s["type"] == "param"}

    def args_of(pv) -> dict[Any, tuple[Any, ...]]:
        t = _trace(guide, pv, args, kwargs)
        return {n: tuple(jnp.asarray(getattr(unwrap_distribution(t[n]["fn"])[0], a)) for a in read[n][2])
                for n in latent_names}

    jac = jax.jacobian(args_of)(values)
    names = []
    for n in latent_names:
        per = []
        for j, arg in enumerate(read[n][2]):
            feeds = [p for p in values if _is_identity(jac[n][j][p])]
            others = [p for p in values if p not in feeds and bool(jnp.any(jac[n][j][p] != 0))]
            if len(feeds) != 1 or others:
                raise GuideParamsError(
                    f"argument {arg!r} of guide site {n!r} must be one numpyro.param used as is (found it depends on "
                    f"{sorted(feeds + others) or 'no param'}); write e.g. dist.Beta(a, b) with a, b numpyro.param")
            per.append(feeds[0])
        names.append(tuple(per))
    family = ProductFamily(tuple(read[n][0] for n in latent_names))
    lam = jnp.concatenate([jnp.reshape(read[n][1], (-1,)) for n in latent_names])
    return GuideMap(family, tuple(names), values), lam


def _is_identity(block) -> bool:
    block = np.asarray(block)
    size = int(np.sqrt(block.size)) if block.size else 0
    if size * size != block.size or size == 0:
        return False
    return bool(np.allclose(block.reshape(size, size), np.eye(size), rtol=0.0, atol=1e-12))


def write_params(guide_map, family, lam) -> dict[str, Any]:
    """The guide's params describing ``lam`` (params the guide does not use are passed through).

    :raises GuideParamsError: if ``family`` is not the guide's.
    """
    if tuple(type(f) for f in family.factors) != tuple(type(f) for f in guide_map.family.factors):
        raise GuideParamsError("the posterior's families differ from the guide's sample sites")
    out = dict(guide_map.params)
    for factor, names, part in zip(family.factors, guide_map.names, family.split(lam)):
        for name, value in zip(names, factor.to_args(part)):
            out[name] = jnp.reshape(value, jnp.shape(guide_map.params[name]))
    return out
