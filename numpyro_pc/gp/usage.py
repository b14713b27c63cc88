"""User helpers for a streaming sparse GP: persistent compilation cache, progress bar, plotting.

* :func:`enable_compilation_cache` (the package's :func:`numpyro_pc.compilation_cache.enable_compilation_cache`,
  which importing the package already calls unless told not to) turns on JAX's persistent
  compilation cache, so the jitted per-batch update is compiled once per machine (not once
  per process): a second run of the same stream compiles nothing.
* :func:`progress` wraps an iterable of batches in a ``tqdm`` bar when the output is a
  terminal and not in CI (``CI`` set); ``NUMPYRO_PC_PROGRESS=0/1`` forces it off/on.
* :func:`plot_gp` draws the predictive band (1-D inputs) or the predictive mean (2-D
  inputs), the inducing inputs and the current batch (:meth:`StreamingSparseGP.plot`).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..compilation_cache import default_cache_dir, enable_compilation_cache  # noqa: F401  (re-exported here)
from ..errors import DataShapeError, NotFittedError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

__all__ = ["enable_compilation_cache", "default_cache_dir", "progress", "use_progress", "plot_gp"]


def use_progress(progress=None) -> bool:
    """Whether to show a progress bar: ``progress`` if given, else ``NUMPYRO_PC_PROGRESS``, else
    only on a terminal outside CI."""
    if progress is not None:
        return bool(progress)
    env = os.environ.get("NUMPYRO_PC_PROGRESS")
    if env is not None:
        return env not in ("0", "", "false", "False")
    return sys.stderr.isatty() and not os.environ.get("CI")


def progress(iterable, total=None, desc="batches", enabled=None) -> Iterable[Any]:
    """``tqdm(iterable)`` when :func:`use_progress` says so, else ``iterable`` unchanged."""
    if not use_progress(enabled):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def plot_gp(sgp, X=None, y=None, ax=None, grid=None, resolution=200, show_inducing=True) -> Any:
    """Plot a streaming GP with 1-D or 2-D inputs.

    1-D: data (grey), the batch ``(X, y)`` (black), predictive mean ± 2 sd of ``y``, and
    the inducing inputs at their posterior mean (red). 2-D: filled contours of the
    predictive mean (probability of class 1 for Bernoulli), the batch coloured by ``y``, and
    the inducing inputs (black triangles).

    :param sgp: a fitted :class:`~numpyro_pc.gp.StreamingSparseGP`.
    :param X: the current batch's inputs (optional).
    :param y: the current batch's targets (optional).
    :param ax: a Matplotlib axes (default: a new figure).
    :param grid: 1-D: test inputs ``(G, 1)``; 2-D: ``(g1, g2)`` axis vectors (default: from ``Z`` and ``X``).
    :param int resolution: grid size per axis when ``grid`` is not given.
    :param bool show_inducing: draw the inducing inputs.
    :return: the axes.
    """
    import matplotlib.pyplot as plt

    if sgp.state is None:
        raise NotFittedError("plot needs at least one update() first")
    Z = np.asarray(sgp.state.Z)
    D = Z.shape[1]
    if D not in (1, 2):
        raise DataShapeError(f"plot supports 1-D and 2-D inputs, the stream has {D}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5 if D == 1 else 5))
    pts = Z if X is None else np.concatenate([Z, np.asarray(X, float).reshape(-1, D)])
    lo, hi = pts.min(0), pts.max(0)
    pad = 0.1 * (hi - lo) + 1e-9
    if D == 1:
        g = np.linspace(lo[0] - pad[0], hi[0] + pad[0], resolution)[:, None] if grid is None else np.asarray(grid)
        mu, var = sgp.predict_y(g)
        sd = np.sqrt(var)
        ax.fill_between(g[:, 0], mu - 2 * sd, mu + 2 * sd, color="C0", alpha=0.2)
        ax.plot(g[:, 0], mu, "C0")
        if X is not None:
            ax.plot(np.asarray(X).reshape(-1), np.asarray(y).reshape(-1), "k.", ms=3)
        if show_inducing:
            ax.plot(Z[:, 0], sgp.predict(Z)[0], "o", color="C3", ms=4)
    else:
        g1, g2 = (np.linspace(lo[i] - pad[i], hi[i] + pad[i], resolution // 2) for i in range(2)) \
            if grid is None else grid
        G = np.stack(np.meshgrid(g1, g2), -1).reshape(-1, 2)
        mu, _ = sgp.predict_y(G)
        ax.contourf(g1, g2, mu.reshape(len(g2), len(g1)), levels=20, cmap="RdBu_r", alpha=0.6)
        if X is not None:
            ax.scatter(np.asarray(X)[:, 0], np.asarray(X)[:, 1], c=np.asarray(y), s=5, cmap="RdBu_r",
                       edgecolors="k", linewidths=0.2)
        if show_inducing:
            ax.plot(Z[:, 0], Z[:, 1], "k^", ms=4)
    ax.set_title(f"after batch {len(sgp.history)}", fontsize=9)
    return ax
