r"""Exponential families over the flat unconstrained latent vector ``z``: the registry.

The protocol and the Gaussian pytrees live in :mod:`numpyro_pc.protocols.family`, the full,
diagonal and isotropic Gaussians in :mod:`numpyro_pc.families.gaussians`, the low-rank family in
:mod:`numpyro_pc.families.lowrank` (registered through :func:`register_family_factory`, names
``"lowrank-r"``). New families subclass :class:`GaussianFamily` (docs/architecture.md,
"Adding a family").

This module is the registry (:func:`get_family`, :func:`register_family`,
:func:`register_family_factory`) and re-exports the protocol
(:mod:`numpyro_pc.protocols.family`) and the Gaussian families (:mod:`numpyro_pc.families.gaussians`).
"""

from __future__ import annotations

from collections.abc import Iterable

from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.options import is_choice
from numpyro_pc.protocols import family as _family_protocol
from numpyro_pc.protocols.family import (
    Family,
    GaussianFamily,
    Gaussian,
    GaussianNatural,
    add_site,
    regularised_chol,
    remove_site,
    scale_site,
)

from .gaussians import DiagonalGaussian, FullGaussian, IsotropicGaussian
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "Gaussian",
    "GaussianNatural",
    "Family",
    "GaussianFamily",
    "FullGaussian",
    "DiagonalGaussian",
    "IsotropicGaussian",
    "get_family",
    "register_family",
    "register_family_factory",
    "registered_families",
    "regularised_chol",
    "add_site",
    "remove_site",
    "scale_site",
]

_FAMILIES = {"full": FullGaussian(), "diagonal": DiagonalGaussian(), "isotropic": IsotropicGaussian()}
_ALIASES = {"diag": "diagonal", "iso": "isotropic", "dense": "full"}
_FACTORIES: dict[str, Any] = {}


def register_family_factory(prefix: str, build, parse) -> None:
    """Make a parametrised family available as ``prefix`` with options and as ``"prefix-suffix"``.

    ``get_family(prefix, **options)`` returns ``build(**options)`` and ``get_family("prefix-s")``
    returns ``build(**parse("s"))``; the family built must be named ``"prefix-s"`` so that saved
    files name it completely (``LowRankGaussian(rank=5)`` is ``"lowrank-5"``).
    """
    if prefix in _FAMILIES or prefix in _ALIASES:
        raise InvalidOptionError(f"the family name {prefix!r} is taken")
    _FACTORIES[prefix] = (build, parse)


def register_family(family: GaussianFamily, aliases: Iterable[str] = ()) -> GaussianFamily:
    """Make ``family`` (a :class:`GaussianFamily` instance) available by its ``name``.

    After registration ``pc.fit(..., family=name)``, saved files and every operation accept
    it; docs/architecture.md, "Adding a family", lists the methods a family implements.

    :raises InvalidOptionError: ``family`` is not a :class:`GaussianFamily`, or its
        name or an alias is taken by another family.
    """
    if not isinstance(family, GaussianFamily):
        raise InvalidOptionError(f"register_family expects a GaussianFamily instance (a Gaussian family over z; a factor of "
                                   f"a product registers with register_factor), found {type(family).__name__}")
    for name in (family.name, *aliases):
        taken = _FAMILIES.get(_ALIASES.get(name, name))
        if taken is not None and taken != family:
            raise InvalidOptionError(f"the family name {name!r} is taken by {taken!r}")
    _FAMILIES[family.name] = family
    _ALIASES.update({alias: family.name for alias in aliases})
    return family


def registered_families() -> dict[Any, Any]:
    """``{name: family}`` of every registered family."""
    return dict(_FAMILIES)


def get_family(family: str | GaussianFamily, **options) -> GaussianFamily:
    """Return a family instance from a registered name (``"full"``, ``"diagonal"``, ``"isotropic"``,
    ``"lowrank-5"``, …) or instance; ``options`` parametrise a family registered with
    :func:`register_family_factory` (``get_family("lowrank", rank=5)``).

    :raises InvalidOptionError: an unknown name, or options for a family that takes none.
    """
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(family, GaussianFamily):
        if options:
            raise InvalidOptionError(f"options {sorted(options)} apply to a family name, not to {family!r}")
        return family
    key = _ALIASES.get(family, family) if isinstance(family, str) else family
    if isinstance(key, str):
        head, sep, tail = key.partition("-")
        if head in _FACTORIES and (sep or options or key not in _FAMILIES):
            build, parse = _FACTORIES[head]
            made = build(**{**(parse(tail) if sep else {}), **options})
            return _FAMILIES.get(made.name) or register_family(made)
        if options:
            raise InvalidOptionError(f"the {key!r} family takes no options (got {sorted(options)})")
    if not is_choice(key, _FAMILIES):
        raise InvalidOptionError(f"unknown family {family!r}; expected one of {sorted(_FAMILIES) + sorted(_FACTORIES)} "
                                 "or a GaussianFamily")
    return _FAMILIES[key]



def __getattr__(name: str) -> type:
    if name == "ExponentialFamily":
        return _family_protocol.__getattr__(name)  # renamed: warns there, naming GaussianFamily
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
