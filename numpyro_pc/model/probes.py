"""Fixed, seeded probe points drawn on the host.

Binding a model and choosing its expectation rule evaluate it at a few generic points: to
find which latents each example depends on, whether its distribution parameters are affine
in them, whether the prior's Hessian is diagonal or constant, and whether the per-example
losses add up to the model's log density. Those points only need to be generic and
reproducible. Drawn with NumPy they cost nothing to compile; drawn with ``jax.random`` outside
``jit`` each shape compiled its own sampler (1–3 s of a cold ``pc.fit`` on two cores), see
``benchmarks/RESULTS.md`` ("Cold start").
"""

from __future__ import annotations

import numpy as np

__all__ = ["normal", "uniform", "coin_flips"]


def _generator(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed)))


def normal(seed: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Standard-normal draws of ``shape`` in ``dtype``, the same for the same ``seed`` in every process
    (a host array: a constant wherever it is used, also inside traced code)."""
    return _generator(seed).standard_normal(shape).astype(np.dtype(dtype))


def uniform(seed: int, shape: tuple[int, ...], low: float, high: float, dtype) -> np.ndarray:
    """Uniform draws on ``[low, high)`` of ``shape`` in ``dtype``, the same for the same ``seed``."""
    return _generator(seed).uniform(low, high, shape).astype(np.dtype(dtype))


def coin_flips(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Fair boolean draws of ``shape``, the same for the same ``seed``."""
    return _generator(seed).random(shape) < 0.5
