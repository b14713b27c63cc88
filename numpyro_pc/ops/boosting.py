r"""Boosting training from a checkpoint (paper §4.2): a fit that starts from a stored posterior.

A checkpoint in dual form, :math:`q_{chk} \propto p_0 \prod_{i \in C} \exp(-\hat\ell_{i|chk})`,
rewrites the target of a fit to the data :math:`D` without changing it,

.. math::

    p_0 \prod_{i \in D} e^{-\ell_i} \;=\; q_{chk} \prod_{i \in D \cap C} e^{-(\ell_i - \hat\ell_{i|chk})}
        \prod_{i \in D \setminus C} e^{-\ell_i},

so the boosted BLR step taken at :math:`q_{old}` (paper §4.2, with :math:`\alpha = \rho / (1 + \rho)`)

.. math::

    q_{new} = \arg\min_{\mu}\; \sum_{i} \mu^\top \nabla_\mu E_{q_\mu}[\ell_i - \hat\ell_{i|chk}]
        + \tfrac{1}{\alpha} \mathrm{KL}\big(q_\mu \,\|\, q_{chk}^{\alpha}\, q_{old}^{1-\alpha}\big)

has the fixed point of the unboosted fit, :math:`\lambda = \lambda_0 + \sum_{i\in D} \hat\lambda_i`:
examples the checkpoint has no site for (:math:`D \setminus C`) enter with their full loss, and the
checkpoint's sites of examples outside :math:`D` are divided out with the rest. Written in natural
parameters the step is :math:`(1-\alpha)\lambda_{old} + \alpha(\lambda_{chk} - \sum_C \hat\lambda_{i|chk}
+ \sum_D \hat\lambda_i(q_{old}))`, and :math:`\lambda_{chk} - \sum_C \hat\lambda_{i|chk} = \lambda_0` is
the checkpoint's dual form: term by term, it is the step the package's solver
(:func:`~numpyro_pc.solvers.gaussian.solve`, every site and the prior recomputed at each iterate)
takes on the fit's problem. What the checkpoint changes is where the iteration starts —
:math:`q_{chk}` instead of the MAP/Laplace search from the prior — and so how many steps it needs.
The fixed Gaussian factor of the boosted problem, :math:`q_{chk}` with all of its sites and its
prior site divided out, is therefore not formed from the difference of two large sums: it is the
prior's own, and its rounding error never reaches the answer.

A neighbouring model (one more feature, a latent renamed) reads the checkpoint through a
*mapping* of its flat unconstrained coordinates (:func:`checkpoint_map`): the shared coordinates
start from the checkpoint's mean and the precision of its marginal over them, the model's other
coordinates from the prior's start (mean 0 and the prior's curvature), independent of the first.

:func:`numpyro_pc.boost` is the entry point; this module holds the mapping and the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import DataShapeError, IncompatiblePosteriorsError, MissingCapabilityError, ModelMismatchError
from numpyro_pc.families.registry import Gaussian
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.solvers.start import default_start

__all__ = ["CheckpointMap", "checkpoint_map", "BoostStart", "boosted_start", "MAX_MAPPED_DIM"]

#: the largest latent dimension whose checkpoint is carried through dense precisions (a mapped,
#: renamed or re-familied checkpoint); an identical layout in the same family is copied at any size
MAX_MAPPED_DIM = 4096


class CheckpointMap(NamedTuple):
    """Where the checkpoint's flat unconstrained coordinates go in the boosted model's.

    :ivar source: positions in the checkpoint's flat latent vector.
    :ivar target: the positions they take in the boosted model's (same length as ``source``).
    :ivar from_prior: the boosted model's positions no checkpoint coordinate fills.
    :ivar int checkpoint_dim: the checkpoint's latent dimension.
    :ivar bool identity: the two layouts are the same and every coordinate maps to itself.
    """

    source: np.ndarray
    target: np.ndarray
    from_prior: np.ndarray
    checkpoint_dim: int
    identity: bool


class BoostStart(NamedTuple):
    """The boosted solve's start and what it took from the checkpoint.

    :ivar start: the :class:`~numpyro_pc.families.registry.Gaussian` the solver starts from.
    :ivar map: the :class:`CheckpointMap` used.
    :ivar bool precision_from_checkpoint: whether the start's precision on the mapped coordinates is
        the checkpoint's (``False`` for a fixed-precision family, whose precision is the fit's own).
    """

    start: Gaussian
    map: CheckpointMap
    precision_from_checkpoint: bool


def _layout(latent) -> dict[str, tuple[int, int, tuple]]:
    """``{site: (offset, size, unconstrained shape)}`` of a :class:`~numpyro_pc.model.latent.LatentSpace`."""
    return {name: (offset, size, tuple(shape)) for name, offset, size, shape
            in zip(latent.names, latent.offsets, latent.sizes, latent.unconstrained_shapes)}


def _describe(layout) -> str:
    return ", ".join(f"{name}: {shape or '()'} ({size})" for name, (_, size, shape) in layout.items())


def _entry(name, value, old, new) -> tuple[str, np.ndarray]:
    """One mapping entry as ``(checkpoint site, positions in the new site)``, checked against both layouts.

    :raises ModelMismatchError: a site name that is not a latent of the model it should be in.
    :raises DataShapeError: positions of the wrong length, out of range, repeated or not integers.
    """
    if name not in new:
        raise ModelMismatchError(f"mapping names {name!r}, which is not a latent site of the boosted model; its "
                                 f"latent sites are {{{_describe(new)}}}", differences=(f"unknown site {name!r}",))
    source_name, positions = (value if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
                              else (name, value))
    if source_name not in old:
        raise ModelMismatchError(f"mapping[{name!r}] reads the checkpoint's site {source_name!r}, which it does not "
                                 f"have; its latent sites are {{{_describe(old)}}}",
                                 differences=(f"unknown checkpoint site {source_name!r}",))
    found = np.asarray(positions)
    old_size, new_size = old[source_name][1], new[name][1]
    if found.ndim != 1 or found.shape[0] != old_size or (found.size and not np.issubdtype(found.dtype, np.integer)):
        raise DataShapeError(f"mapping[{name!r}] must give, for each of the {old_size} unconstrained coordinates of "
                             f"the checkpoint's site {source_name!r}, its position in the boosted model's site "
                             f"{name!r} (integers in [0, {new_size})); got an array of shape {found.shape} and dtype "
                             f"{found.dtype}")
    if found.size and (found.min() < 0 or found.max() >= new_size or np.unique(found).size != found.size):
        raise DataShapeError(f"mapping[{name!r}] must give {old_size} distinct positions in [0, {new_size}) (the "
                             f"size of the boosted model's site {name!r}); got values from {int(found.min())} to "
                             f"{int(found.max())} with {found.size - np.unique(found).size} repeated")
    return source_name, found.astype(np.int64)


def checkpoint_map(checkpoint_latent, latent, mapping: Mapping | None = None) -> CheckpointMap:
    """How the checkpoint's latents (``checkpoint_latent``) map onto the boosted model's (``latent``).

    Without ``mapping`` the two models must have the same latent sites with the same unconstrained
    shapes. ``mapping`` is a dict ``{site of the boosted model: positions}`` or ``{site: (checkpoint
    site, positions)}`` where ``positions[k]`` is the flat position, inside the boosted model's site,
    of the checkpoint site's ``k``-th flat unconstrained coordinate (e.g. ``{"w": np.arange(d)}``
    when ``w`` gained a feature at the end). Sites ``mapping`` does not name map to the checkpoint's
    site of the same name and shape; the boosted model's remaining sites (and coordinates) start from
    the prior, and checkpoint sites nothing reads are marginalised out.

    :raises ModelMismatchError: without ``mapping``, layouts that differ (the differences listed);
        with it, a site of the same name and another shape that it does not map, or a name it uses
        that is not a latent site.
    :raises DataShapeError: a mapping entry whose positions do not fit the two sites.
    """
    old, new = _layout(checkpoint_latent), _layout(latent)
    if mapping is None:
        differences = [f"{name}: checkpoint {old[name][2] if name in old else 'absent'}, model "
                       f"{new[name][2] if name in new else 'absent'}"
                       for name in dict.fromkeys([*old, *new]) if old.get(name, (0, 0, None))[2:] !=
                       new.get(name, (0, 0, None))[2:]]
        if differences or list(old) != list(new):
            differences = differences or [f"site order: checkpoint {list(old)}, model {list(new)}"]
            raise ModelMismatchError(
                f"the checkpoint's latents {{{_describe(old)}}} are not the boosted model's {{{_describe(new)}}} "
                f"({'; '.join(differences)}); pass mapping={{site: positions}} to say where the checkpoint's "
                "coordinates go", differences=differences)
        every = np.arange(latent.dim)
        return CheckpointMap(every, every, np.zeros(0, np.int64), int(checkpoint_latent.dim), True)
    if not isinstance(mapping, Mapping):
        raise DataShapeError(f"mapping must be a dict {{site of the boosted model: positions}}; got "
                             f"{type(mapping).__name__}")
    entries = {name: _entry(name, value, old, new) for name, value in mapping.items()}
    for name, (_, size, shape) in new.items():
        if name in entries or name not in old:
            continue
        if old[name][2] != shape:
            raise ModelMismatchError(
                f"the latent site {name!r} has unconstrained shape {old[name][2]} in the checkpoint and {shape} in the "
                f"boosted model, and mapping does not say how it maps; add mapping[{name!r}] (positions of its "
                f"{old[name][1]} checkpoint coordinates among the model's {size})",
                differences=(f"{name}: checkpoint {old[name][2]}, model {shape}",))
        entries[name] = (name, np.arange(size))
    source, target = [], []
    for name, (source_name, positions) in entries.items():
        source.append(old[source_name][0] + np.arange(old[source_name][1]))
        target.append(new[name][0] + positions)
    source_flat = np.concatenate(source) if source else np.zeros(0, np.int64)
    target_flat = np.concatenate(target) if target else np.zeros(0, np.int64)
    if np.unique(source_flat).size != source_flat.size:
        raise DataShapeError("mapping reads some checkpoint coordinates twice (two boosted-model sites map from the "
                             "same checkpoint site); each checkpoint coordinate may go to one place only")
    from_prior = np.setdiff1d(np.arange(latent.dim), target_flat)
    identity = (int(checkpoint_latent.dim) == int(latent.dim) and from_prior.size == 0
                and np.array_equal(source_flat, target_flat))
    return CheckpointMap(source_flat, target_flat, from_prior, int(checkpoint_latent.dim), identity)


def boosted_start(checkpoint, spec, data, family, dtype, mapping: Mapping | None = None) -> BoostStart:
    """The start of a boosted fit of ``spec``/``data`` in ``family``: the checkpoint, mapped (module docstring).

    :param checkpoint: a Gaussian dual-form posterior (:class:`~numpyro_pc.dual.base.DualPosteriorBase`).
    :param spec: the boosted model's binding; ``data`` its data.
    :param family: the boosted fit's :class:`~numpyro_pc.families.registry.GaussianFamily`.
    :param dtype: the computation's floating dtype.
    :param mapping: see :func:`checkpoint_map`.
    :raises IncompatiblePosteriorsError: a checkpoint that is not a Gaussian posterior.
    :raises MissingCapabilityError: a mapped start beyond :data:`MAX_MAPPED_DIM` latents.
    """
    state = getattr(checkpoint, "state", None)
    if not (isinstance(state, Gaussian) and hasattr(checkpoint, "family") and hasattr(checkpoint.family, "dense_precision")):
        raise IncompatiblePosteriorsError(
            f"checkpoint must be a Gaussian dual-form posterior (pc.fit, pc.dual_form, an update or a merge of them); "
            f"got {type(checkpoint).__name__}")
    cmap = checkpoint_map(checkpoint.spec.latent, spec.latent, mapping)
    mean = np.asarray(state.mean, dtype=np.float64)
    fixed = capability(family, FixedPrecision) is not None
    same_family = type(family) is type(checkpoint.family) and family == checkpoint.family
    if cmap.identity and (same_family or fixed):
        precision = (default_start(spec, data, family, "prior", dtype).start.precision if fixed
                     else jnp.asarray(state.precision, dtype))
        return BoostStart(Gaussian(jnp.asarray(mean, dtype), precision), cmap, not fixed)
    if max(cmap.checkpoint_dim, spec.latent.dim) > MAX_MAPPED_DIM:
        raise MissingCapabilityError(
            f"a checkpoint read through a mapping or into another family is carried through dense precisions, up to "
            f"{MAX_MAPPED_DIM} latents; this one has {cmap.checkpoint_dim} and the boosted model {spec.latent.dim}. "
            "Boost a model with the checkpoint's latent layout, in the checkpoint's family")
    prior = default_start(spec, data, family, "prior", dtype).start
    start_mean = np.asarray(prior.mean, np.float64).copy()
    start_mean[cmap.target] = mean[cmap.source]
    if fixed:
        return BoostStart(Gaussian(jnp.asarray(start_mean, dtype), prior.precision), cmap, False)
    # the checkpoint's marginal over the coordinates it passes on, independent of the prior's block
    covariance = np.linalg.inv(np.asarray(checkpoint.family.dense_precision(state), np.float64))
    shared = np.linalg.inv(covariance[np.ix_(cmap.source, cmap.source)])
    dense = np.asarray(family.dense_precision(prior), np.float64).copy()
    dense[cmap.target, :] = 0.0
    dense[:, cmap.target] = 0.0
    dense[np.ix_(cmap.target, cmap.target)] = 0.5 * (shared + shared.T)
    precision = family.project_curvature(jnp.asarray(dense, dtype))
    if not bool(family.is_positive_definite(precision)):  # a family whose projection lost definiteness
        return BoostStart(Gaussian(jnp.asarray(start_mean, dtype), prior.precision), cmap, False)
    return BoostStart(Gaussian(jnp.asarray(start_mean, dtype), precision), cmap, True)
