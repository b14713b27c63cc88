"""Checks of the options users pass to the public entry points.

An option with a value outside its range is refused up front with an
:class:`~numpyro_pc.errors.InvalidOptionError` that names the option, what it expects and
what it got — whether or not the chosen method happens to read it, so that a typo'd or
meaningless value never passes silently (``delete(ids, tol=-1)`` with the default
``method="remove_site"``, which runs no solver, is refused as well). Python's own
``ValueError``/``TypeError`` from deep inside a computation, or a compiler's error for a
negative array size, are never what a user sees.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from .errors import InvalidOptionError

_R = TypeVar("_R")

__all__ = ["solver_group", "check_tol", "check_count", "check_solver_options", "check_finite", "check_key", "check_path", "check_flag",
           "check_name", "check_names", "is_choice", "MAX_COUNT", "MAX_SEED", "SolverOptions", "resolve_solver"]


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_tol(value, name: str = "tol") -> float | None:
    """``None``, or a finite positive float.

    :raises InvalidOptionError:
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or float(value) <= 0.0:
        raise InvalidOptionError(f"{name} must be a finite positive number or None; got {_describe(value)}")
    return float(value)


MAX_COUNT = 2**31 - 1  # counts and sizes beyond this overflow the integer types JAX and XLA use
MAX_SEED = 2**32 - 1  # the largest seed a PRNG key holds (and a saved file may carry)


def is_choice(value, choices) -> bool:
    """Whether ``value`` is one of the names ``choices`` — a string compared as a string, so that an
    unhashable value or an array never reaches ``in`` (a ``TypeError`` or NumPy's ambiguous truth value)."""
    return isinstance(value, str) and value in choices


def check_count(value, name: str, minimum: int = 1, allow_none: bool = True, maximum: int = MAX_COUNT) -> int | None:
    """``None`` (when allowed), or an integer in ``[minimum, maximum]`` (a float is refused, never rounded).

    :raises InvalidOptionError:
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= int(value) <= maximum:
        expected = f"an integer in [{minimum}, {maximum}]" + (" or None" if allow_none else "")
        raise InvalidOptionError(f"{name} must be {expected}; got {_describe(value)}")
    return int(value)


def check_flag(value, name: str) -> bool:
    """``True`` or ``False`` (NumPy booleans included; numbers, strings and arrays are refused).

    :raises InvalidOptionError:
    """
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidOptionError(f"{name} must be True or False; got {_describe(value)}")
    return bool(value)


def check_name(value, name: str) -> str | None:
    """A single name (``str``) or ``None``, e.g. ``data_plate``.

    :raises InvalidOptionError:
    """
    if value is None or isinstance(value, str):
        return value
    raise InvalidOptionError(f"{name} must be a name (str) or None; got {_describe(value)}")


def check_names(value, name: str) -> tuple[str, ...]:
    """A tuple (or list) of names, e.g. ``shared``.

    :raises InvalidOptionError:
    """
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidOptionError(f"{name} must be a tuple of names (str); got {_describe(value)}")


def check_solver_options(tol=None, max_iters=None) -> None:
    """The tolerance and iteration budget every solve takes (see :func:`check_tol`, :func:`check_count`).

    :raises InvalidOptionError:
    """
    check_tol(tol)
    check_count(max_iters, "max_iters")


def check_finite(value, name: str, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite real number in ``[low, high]``.

    :raises InvalidOptionError:
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or not low <= float(value) <= high:
        raise InvalidOptionError(f"{name} must be a finite number in [{low}, {high}]; got {_describe(value)}")
    return float(value)


def check_key(key, name: str = "key") -> None:
    """A JAX PRNG key (``jax.random.key(…)`` or the raw ``uint32`` pair of ``PRNGKey``).

    :raises InvalidOptionError:
    """
    raw = getattr(key, "dtype", None) is not None and getattr(key, "shape", None) == (2,) \
        and str(key.dtype) == "uint32"
    typed = getattr(key, "dtype", None) is not None and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not (raw or typed):
        raise InvalidOptionError(f"{name} must be a JAX PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)); "
                                 f"got {_describe(key)}")


def check_path(path, name: str = "path") -> None:
    """A file-system path (``str`` or ``os.PathLike``).

    :raises InvalidOptionError:
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidOptionError(f"{name} must be a str or os.PathLike file path; got {_describe(path)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """How the natural-gradient solve runs: the ``solver=`` group of :func:`numpyro_pc.fit` and
    :func:`numpyro_pc.dual_form` (the keywords ``tol=``, ``max_iters=``, ``progress=`` and
    ``raise_on_failure=`` are the same options spelled flat; give one spelling or the other).
    Values are checked when the group is built; its ``repr`` prints every field.

    :param float tol: relative residual at which the solve stops; ``None``: ``1e-8``.
    :param int max_iters: iterations; ``None``: 100, extended while the run converges linearly
        (:func:`numpyro_pc.solvers.gaussian.solve`).
    :param bool progress: show a progress bar.
    :param bool raise_on_failure: raise when the solve misses ``tol`` (``False``: warn and
        return the last iterate, with the record saying so).
    """

    tol: float | None = None
    max_iters: int | None = None
    progress: bool = False
    raise_on_failure: bool = True

    def __post_init__(self) -> None:
        check_solver_options(self.tol, self.max_iters)
        check_flag(self.progress, "progress")
        check_flag(self.raise_on_failure, "raise_on_failure")


def resolve_solver(solver, tol=None, max_iters=None, progress=False, raise_on_failure=True) -> SolverOptions:
    """The solver options of a call that takes both ``solver=`` and the flat keywords.

    :raises InvalidOptionError: ``solver`` is not a :class:`SolverOptions`, or it is given together
        with a flat keyword set away from its default (two spellings of one option).
    """
    flat = SolverOptions(tol=tol, max_iters=max_iters, progress=progress, raise_on_failure=raise_on_failure)
    if solver is None:
        return flat
    defaults = SolverOptions()
    _check_group(solver, {f.name: (getattr(flat, f.name), getattr(defaults, f.name))
                          for f in dataclasses.fields(SolverOptions)})
    return solver


def _check_group(solver, given) -> None:
    """Refuse a ``solver=`` that is not a :class:`SolverOptions`, or one given beside a flat keyword set away
    from its default (``given``: name → (value, default)): the same option spelled twice.

    :raises InvalidOptionError:
    """
    if not isinstance(solver, SolverOptions):
        raise InvalidOptionError(f"solver= takes a numpyro_pc.SolverOptions; got {solver!r} ({type(solver).__name__})")
    twice = [name for name, (value, default) in given.items() if value != default]
    if twice:
        raise InvalidOptionError(f"the solver's options were given twice: solver={solver!r} and the keyword(s) "
                                 f"{twice}; give them in one place (e.g. SolverOptions({twice[0]}=...)).")


def solver_group(method: Callable[..., _R]) -> Callable[..., _R]:
    """Let ``method`` take its solver keywords (those of :class:`SolverOptions` it has) as one ``solver=``
    group too: ``post.update(X, y, solver=SolverOptions(tol=1e-10))`` is ``post.update(X, y, tol=1e-10)``.

    A group given with one of those keywords set away from its default is refused, as is a group setting
    an option the method does not have (e.g. ``progress`` for a deletion, which shows no progress bar).
    """
    signature = inspect.signature(method)
    names = [f.name for f in dataclasses.fields(SolverOptions) if f.name in signature.parameters]

    @functools.wraps(method)
    def with_group(*args: Any, solver: SolverOptions | None = None, **kwargs: Any) -> _R:
        if solver is None:
            return method(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        _check_group(solver, {n: (bound.arguments[n], signature.parameters[n].default)  # the method's own defaults
                              for n in names if n in bound.arguments})
        group = solver
        missing = [f.name for f in dataclasses.fields(SolverOptions)
                   if f.name not in names and getattr(group, f.name) != getattr(SolverOptions(), f.name)]
        if missing:
            raise InvalidOptionError(f"{method.__name__}() has no option {missing[0]!r}; got solver={group!r}")
        bound.arguments.update({n: getattr(group, n) for n in names})
        return method(*bound.args, **bound.kwargs)

    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("solver", inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation="SolverOptions | None"))
    with_group.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    with_group.__doc__ = (method.__doc__ or "").rstrip() + (
        "\n\n        :param SolverOptions solver: the solver keywords " + ", ".join(f"``{n}``" for n in names)
        + " as one group (:class:`~numpyro_pc.options.SolverOptions`); give either it or them.\n")
    return with_group
