"""The shared pieces of the posteriordb translations: data lookup and the translation records.

:mod:`numpyro_pc.posteriordb.reference` (posteriors with reference draws) and
:mod:`numpyro_pc.posteriordb.hierarchical` (hierarchical posteriors without them) both build
:class:`Translation` records from the data files found by :func:`posteriordb_dir`.
"""

from __future__ import annotations

import json
from typing import Callable, NamedTuple

import numpy as np
import numpyro.distributions as dist

from numpyro_pc.datasets.loaders import DatasetError, data_roots
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

__all__ = ["ReferencePosterior", "Translation", "posteriordb_dir", "require_posteriordb_dir", "load_data", "stan_names",
           "stack_draws", "flat_prior"]


class ReferencePosterior(NamedTuple):
    """A posteriordb posterior (formerly ``Posterior``): ``data`` (dict of arrays, keys as in Stan's ``data`` block),
    ``summary`` (``{stan_name: {"mean", "sd", "q05", "q50", "q95"}}``) and ``draws``
    (``{stan_name: (1000,) array}``)."""

    name: str
    data: dict
    summary: dict
    draws: dict


class Translation(NamedTuple):
    """A NumPyro translation: call ``model(*args, **kwargs)``.

    ``params`` maps each latent site name to its Stan reference names in C order of the
    site's constrained shape (e.g. ``{"beta": ["beta[1]", "beta[2]"], "sigma": ["sigma"]}``);
    ``reference`` turns the reference draws into constrained draws of the latent sites
    (``{site: (num_draws, *shape)}``), deriving sites the reference does not store
    (e.g. non-centred ``theta_trans`` from ``theta, mu, tau``).
    """

    model: Callable
    args: tuple
    kwargs: dict
    params: dict
    reference: Callable


def posteriordb_dir(path=None) -> Path | None:
    """The ``posteriordb`` folder of the data directory (``None`` when absent)."""
    for root in data_roots(path):
        for out in (root / "posteriordb", root):
            if (out / "reference").is_dir() and (out / "models").is_dir():
                return out
    return None


def require_posteriordb_dir(path=None) -> Path:
    """The ``posteriordb`` folder of the data directory.

    :raises DatasetError: when there is none.
    """
    folder = posteriordb_dir(path)
    if folder is None:
        raise DatasetError("posteriordb data not found: pass path=, set NUMPYRO_PC_DATA or provide ../shared/data")
    return folder


def load_data(data_name, path=None) -> dict[Any, np.ndarray]:
    """Read ``posteriordb/data/<data_name>.json`` as a dict of arrays (keys as in Stan's ``data`` block).

    :param str data_name: e.g. ``"radon_mn"``.
    :param path: data directory (default: see :mod:`numpyro_pc.datasets.loaders`).
    :raises DatasetError: when the folder or the file is missing.
    """
    file = require_posteriordb_dir(path) / "data" / f"{data_name}.json"
    if not file.exists():
        raise DatasetError(f"no posteriordb data file {file}")
    return {k: np.asarray(v) for k, v in json.loads(file.read_text()).items()}


def stan_names(base, shape) -> list[str]:
    """Stan's names of the scalars of parameter ``base`` of ``shape`` (``beta[1]``, ``z[2,3]``; 1-based)."""
    if shape == ():
        return [base]
    return [f"{base}[{','.join(str(i + 1) for i in idx)}]" for idx in np.ndindex(*shape)]


def stack_draws(draws, params, shapes) -> dict[Any, Any]:
    """Reference draws ``{stan_name: (K,)}`` stacked into ``{site: (K, *shape)}`` by ``params``' name lists."""
    return {site: np.stack([draws[n] for n in names], -1).reshape((-1,) + shapes[site])
            for site, names in params.items()}


def flat_prior(support, shape=()) -> dist.ImproperUniform:
    """Stan's implicit flat prior on a parameter's support (log density 0)."""
    return dist.ImproperUniform(support, (), shape)
