r"""The K-prior's label-free loss: prediction matching (paper §3.1.2–3.1.3 and §4.4).

A past example ``i`` kept in a function-space memory enters a later update through how far
the new model's predictive distribution moves from the old one, not through its label:

.. math::

    \kappa_i(z) = \mathrm{KL}\big(p(\cdot \mid \theta_i^{old}) \,\big\|\, p(\cdot \mid \theta_i(z))\big),

where :math:`\theta_i(z)` are the parameters of example ``i``'s observed distributions (the
model's logits, rates or means; :func:`~numpyro_pc.model.terms.example_params`) and
:math:`\theta_i^{old} = \theta_i(m_t)` their values at the old posterior's mean (the delta
method of the paper's eq. ``pred_match_general``). For a likelihood in its canonical
exponential-family form, :math:`-\log p(y \mid \theta) = -y\,\theta + A(\theta) + c(y)`, the
difference :math:`\ell_i - \kappa_i = -(y_i - \hat y_i^{old})\,\theta_i + \mathrm{const}` is
linear in :math:`\theta_i`; for a model linear in ``z`` it is linear in ``z``, so every
family's site represents it exactly and the K-prior correction of a GLM equals the
correction by the true losses (eq. ``corr_linreg`` for the squared loss).

:func:`prediction_kl` computes the KL of one observed site: NumPyro's registered closed forms,
closed forms in logits for the Bernoulli, binomial (same total count), categorical and Poisson,
or a sum over the support of a distribution that can enumerate it. A distribution with none of these is refused with
:class:`~numpyro_pc.errors.UnsupportedModelError`.

A :class:`~numpyro_pc.model.terms.ModelSpec` with ``matching=True`` carries two more
per-example leaves after the model's own: ``theta_old`` (the ``k`` parameters) and ``matched``
(``1.0`` where the example's loss is :math:`\kappa_i`, ``0.0`` where it is its usual
:math:`\ell_i`), so that the memory and a new batch are one set of rows of one problem.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import xlogy
from numpyro.distributions import (
    BernoulliLogits,
    BernoulliProbs,
    BinomialLogits,
    BinomialProbs,
    CategoricalLogits,
    Distribution,
    ExpandedDistribution,
    Independent,
    MaskedDistribution,
    Poisson,
)
from numpyro.distributions.kl import kl_divergence
from numpyro.distributions.util import sum_rightmost

from numpyro_pc.errors import UnsupportedModelError
from typing import Any

__all__ = ["MATCHING_LEAVES", "prediction_kl", "rebuild", "split_matching", "with_matching"]

MATCHING_LEAVES = 2
"""Per-example leaves a matching binding appends to the model's: ``theta_old`` and ``matched``."""


def split_matching(spec, example) -> tuple[tuple, jax.Array | None, jax.Array | None]:
    """``(model leaves, theta_old, matched)`` of one example (``None, None`` for a plain binding)."""
    if not getattr(spec, "matching", False):
        return tuple(example), None, None
    return tuple(example[:-MATCHING_LEAVES]), example[-2], example[-1]


def with_matching(data, theta_old, matched) -> Any:  # a ModelData (terms imports this module)
    """``data`` (a :class:`~numpyro_pc.model.terms.ModelData`) with the two matching leaves appended.

    :param theta_old: ``(n, k)`` parameters at the old mean.
    :param matched: ``(n,)`` ``1.0`` for memory rows (loss ``κ_i``), ``0.0`` for rows with labels (``ℓ_i``).
    """
    theta_old = jnp.asarray(theta_old)
    matched = jnp.asarray(matched, theta_old.dtype)
    return data._replace(per_example=tuple(data.per_example) + (theta_old, matched))


def rebuild(site, leaves, treedef, mask, theta, pos) -> tuple[Distribution, int]:
    """The observed site's distribution with its ``z``-dependent leaves read from ``theta[pos:]``.

    :return: ``(distribution, position after its parameters)``.
    """
    new_leaves = []
    for leaf, dep in zip(leaves, mask):
        if dep:
            size = int(np.prod(jnp.shape(leaf)))
            new_leaves.append(jnp.reshape(theta[pos:pos + size], jnp.shape(leaf)))
            pos += size
        else:
            new_leaves.append(leaf)
    return jax.tree.unflatten(treedef, new_leaves), pos


def prediction_kl(old: Distribution, new: Distribution, site_name: str = "") -> jax.Array:
    """``KL(old || new)`` per batch element of an observed site's distribution.

    Wrappers (``Independent``, expanded and masked distributions) are unwrapped here, so that
    the closed forms of their base distributions apply.

    :raises UnsupportedModelError: no closed form is known and the support cannot be enumerated.
    """
    if isinstance(old, Independent) and isinstance(new, Independent):
        inner = prediction_kl(old.base_dist, new.base_dist, site_name)
        return sum_rightmost(inner, old.reinterpreted_batch_ndims)
    if isinstance(old, ExpandedDistribution) and isinstance(new, ExpandedDistribution):
        return jnp.broadcast_to(prediction_kl(old.base_dist, new.base_dist, site_name), old.batch_shape)
    if isinstance(old, MaskedDistribution) and isinstance(new, MaskedDistribution):
        inner = prediction_kl(old.base_dist, new.base_dist, site_name)
        return jnp.where(old._mask, inner, 0.0) if not isinstance(old._mask, bool) else inner * old._mask
    closed = _closed_form(old, new)
    if closed is not None:
        return closed
    try:
        return kl_divergence(old, new)
    except NotImplementedError:
        pass
    if old.has_enumerate_support and type(old) is type(new):
        try:  # a support whose size is data (a binomial's per-row total count) cannot be enumerated under a trace
            support = old.enumerate_support(expand=False)
        except jax.errors.ConcretizationTypeError:
            support = None
        if support is not None:
            log_old, log_new = old.log_prob(support), new.log_prob(support)
            terms = jnp.where(jnp.isneginf(log_old), 0.0, jnp.exp(log_old) * (log_old - log_new))
            return jnp.sum(terms, axis=0)
    raise UnsupportedModelError(
        f"correction='kprior' matches each memory example's predictive distribution by KL(p_old || p_new); the "
        f"observed site {site_name!r} is a {type(old).__name__}, for which no closed-form KL is known and whose "
        "support cannot be enumerated. Use correction='memory' (the memory's true losses, with their labels).")


def _bernoulli_kl(old_logits, new_logits) -> jax.Array:
    p = jax.nn.sigmoid(old_logits)
    return (p * (jax.nn.log_sigmoid(old_logits) - jax.nn.log_sigmoid(new_logits))
            + (1.0 - p) * (jax.nn.log_sigmoid(-old_logits) - jax.nn.log_sigmoid(-new_logits)))


def _closed_form(old: Distribution, new: Distribution) -> jax.Array | None:
    """The KLs NumPyro does not register, written in logits (stable where a probability underflows)."""
    if isinstance(old, (BernoulliLogits, BernoulliProbs)) and isinstance(new, (BernoulliLogits, BernoulliProbs)):
        return _bernoulli_kl(old.logits, new.logits)
    if isinstance(old, (BinomialLogits, BinomialProbs)) and isinstance(new, (BinomialLogits, BinomialProbs)):
        return old.total_count * _bernoulli_kl(old.logits, new.logits)
    if isinstance(old, CategoricalLogits) and isinstance(new, CategoricalLogits):
        log_old, log_new = jax.nn.log_softmax(old.logits, -1), jax.nn.log_softmax(new.logits, -1)
        return jnp.sum(jnp.exp(log_old) * (log_old - log_new), -1)
    if isinstance(old, Poisson) and isinstance(new, Poisson):
        a, b = old.rate, new.rate
        return xlogy(a, a) - xlogy(a, b) - a + b
    return None
