"""Deprecated: the correction terms of every family are :mod:`numpyro_pc.ops.handlers`' own.

The exponential-family versions that lived here are now one function for every family:
``ef_correction_factor`` is :func:`numpyro_pc.ops.handlers.correction_factor`,
``check_same_ef_model`` is :func:`numpyro_pc.ops.handlers.check_same_model`, ``factor_point(post,
values)`` is ``post.point_of(values)``, and ``bind_like`` and ``check_terms_agree`` moved to
:mod:`numpyro_pc.ops.handlers`. Importing a name from here still works for one release, with a
``FutureWarning`` that names the new one; the module is removed in the next release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import handlers as _handlers
from numpyro_pc.deprecation import warn_renamed

if TYPE_CHECKING:
    import jax


def _factor_point(post, values) -> jax.Array | dict[str, jax.Array]:
    return post.point_of(values)


def _check_same_ef_model(model, post, num_probes=3) -> None:
    return _handlers.check_same_model(model, post, num_probes)


_MOVED: dict[str, tuple[str, Callable[..., Any]]] = {
    "ef_correction_factor": ("numpyro_pc.ops.handlers.correction_factor", _handlers.correction_factor),
    "check_same_ef_model": ("numpyro_pc.ops.handlers.check_same_model", _check_same_ef_model),
    "factor_point": ("post.point_of(values)", _factor_point),
    "bind_like": ("numpyro_pc.ops.handlers.bind_like", _handlers.bind_like),
    "check_terms_agree": ("numpyro_pc.ops.handlers.check_terms_agree", _handlers.check_terms_agree),
}


def __getattr__(name: str) -> Callable[..., Any]:
    if name in _MOVED:
        new, value = _MOVED[name]
        warn_renamed(f"numpyro_pc.ef_handlers.{name} is deprecated: use {new} (one function for every family); "
                     "numpyro_pc.ef_handlers is removed in the next release")
        return value
    raise AttributeError(f"module 'numpyro_pc.ops.expfam_handlers' has no attribute {name!r}")
