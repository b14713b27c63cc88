"""Inducing-input initialisation policies, applied before each batch (outside traced code).

* ``"keep"`` (Bui et al. 2017): a random ``keep_fraction`` of the old ``Z`` plus new
  inputs drawn from the batch (70 %/30 % by default, 80 %/20 % for banana);
* ``"kmeans"``: a few Lloyd iterations over the old ``Z`` and the new inputs, started from
  the ``"keep"`` choice;
* ``"greedy"``: farthest-point selection among the old ``Z`` and the new inputs, starting
  from the old ``Z`` that is closest to the batch;
* ``"fixed"``: ``Z`` never changes (and is not optimised).

All policies return exactly ``M`` points, so the bound's shapes never change. Every policy is
scale-free: random subsets and Lloyd means move with the data, and the distances of ``"kmeans"``
and ``"greedy"`` are measured per column in units of that column's spread
(:func:`~numpyro_pc.gp.datainit.input_scales`), so multiplying an input column by any constant
multiplies the chosen ``Z`` column by it and changes nothing else. (``Z_init`` is used as given.)
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidOptionError
from ..options import is_choice
from .datainit import input_scales

__all__ = ["POLICIES", "initial_inducing", "next_inducing"]

POLICIES = ("keep", "kmeans", "greedy", "fixed")


def _choose(rng, n, k) -> np.ndarray:
    return rng.choice(n, size=k, replace=n < k)


def initial_inducing(X, M, rng, policy="keep") -> np.ndarray:
    """``M`` inducing inputs for the first batch: a random subset of ``X`` (k-means refined for ``"kmeans"``)."""
    Z = X[_choose(rng, X.shape[0], M)].copy()
    if policy == "kmeans":
        Z = _lloyd(np.concatenate([X, Z]), Z)
    return Z


def next_inducing(Z_old, X, rng, policy="keep", keep_fraction=0.7) -> np.ndarray:
    """Initial ``Z_b`` for a new batch from the old ``Z_a`` and the batch inputs ``X``.

    :param Z_old: ``(M, D)``.
    :param X: the batch inputs (real rows only).
    :param rng: ``numpy.random.Generator``.
    :param str policy: one of :data:`POLICIES`.
    :param float keep_fraction: share of old points kept by ``"keep"``/``"kmeans"``.
    :return: ``(M, D)`` array.
    """
    if not is_choice(policy, POLICIES):
        raise InvalidOptionError(f"inducing policy must be one of {POLICIES}, got {policy!r}")
    if not 0.0 <= keep_fraction <= 1.0:
        raise InvalidOptionError(f"keep_fraction must be in [0, 1], got {keep_fraction}")
    M = Z_old.shape[0]
    if policy == "fixed":
        return Z_old
    if policy == "greedy":
        return _greedy(Z_old, X, M)
    n_keep = int(round(keep_fraction * M))
    n_new = M - n_keep
    n_new_avail = min(n_new, X.shape[0])
    n_keep = M - n_new_avail
    kept = Z_old[rng.choice(M, size=n_keep, replace=False)]
    new = X[rng.choice(X.shape[0], size=n_new_avail, replace=False)]
    Z = np.concatenate([kept, new])
    if policy == "kmeans":
        Z = _lloyd(np.concatenate([Z_old, X]), Z)
    return Z


def _spread(points) -> np.ndarray:
    return input_scales(points)


def _lloyd(points, centres, iters=10) -> np.ndarray:
    centres = centres.copy()
    s = _spread(points)
    for _ in range(iters):
        d = (((points[:, None, :] - centres[None, :, :]) / s) ** 2).sum(-1)
        assign = d.argmin(1)
        for j in range(centres.shape[0]):
            members = points[assign == j]
            if len(members):
                centres[j] = members.mean(0)
    return centres


def _greedy(Z_old, X, M) -> np.ndarray:
    raw = np.concatenate([Z_old, X])
    s = _spread(raw)
    Z_old, X = Z_old / s, X / s
    cand = raw / s
    d_batch = ((Z_old[:, None, :] - X[None, :, :]) ** 2).sum(-1).min(1)
    chosen = [int(d_batch.argmin())]
    dist = ((cand - cand[chosen[0]]) ** 2).sum(-1)
    for _ in range(M - 1):
        j = int(dist.argmax())
        chosen.append(j)
        dist = np.minimum(dist, ((cand - cand[j]) ** 2).sum(-1))
    return raw[chosen]          # the rows themselves: a kept old z stays bit-identical
