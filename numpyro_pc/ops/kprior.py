r"""Function-space memory: the K-prior as posterior correction (paper §3.1.2–3.1.4, §4.4).

``update(..., correction="kprior")`` corrects the retained examples — the *function-space
memory* :math:`\mathcal M` — without their labels. Each memory example enters through
prediction matching (:mod:`numpyro_pc.model.prediction_matching`),

.. math::

    q_{t+1} = \arg\min_q\; E_q[\ell_{new}] + \mathrm{KL}(q \,\|\, q_t)
        + E_q[\ell_0 - \hat\ell_{0|t}] + \sum_{i \in \mathcal M} E_q\big[\kappa_i - \hat\kappa_{i|t}\big],
    \qquad \kappa_i(z) = \mathrm{KL}\big(p(\cdot \mid \theta_i(m_t)) \,\big\|\, p(\cdot \mid \theta_i(z))\big),

with :math:`\hat\kappa_{i|t}` the site of :math:`\kappa_i` at :math:`q_t` in the posterior's
own family (eq. ``varkprior`` with :math:`\ell_i - \hat\ell_{i|t}` replaced by its prediction-
matching part, eqs. ``pred_match_general`` and ``corr_qfull``). With the isotropic family this is
the K-prior of Khan & Swaroop (2021, eq. 8; paper eq. ``kprior_deriv_l0``); richer families
subtract their richer sites, which is the paper's gradient and Hessian matching.

For a model whose observed distributions are canonical exponential families of parameters
affine in the latents (linear and logistic regression, Poisson and softmax GLMs),
:math:`\kappa_i - \hat\kappa_{i|t} = \ell_i - \hat\ell_{i|t}` exactly: the update equals the
correction by the true losses of the same examples (with ``curvature="ggn"`` only when the
distribution takes the natural parameter, e.g. ``logits=``: the Gauss–Newton curvatures of
:math:`\ell_i` and :math:`\kappa_i` in another parametrisation differ). For a network it drops the linearisation
error :math:`r_{i|t}\,[f_i(z) - \hat f_i^{lin}(z)]` — the reason to keep examples with large
residuals (``selection="residual"``).

Bookkeeping: the site table keeps each memory example's true site at :math:`q_{t+1}`
(the retained rows still hold their labels, which the objective above never reads); what the
matching did not re-express of the old sites, :math:`\sum_{\mathcal M}(\hat\ell_{i|t} -
\hat\kappa_{i|t} + \hat\kappa_{i|t+1} - \hat\ell_{i|t+1})`, goes to the posterior's offset, so
:math:`\lambda_{t+1} = \text{offset} + \hat\lambda_0 + \sum_i \hat\lambda_i` holds. It is zero
for the GLMs above (to rounding) and is reported as ``record.linearisation_error``.

Memory per batch: ``memory`` (a count, or a fraction of the batch) of each new batch's examples
join :math:`\mathcal M`, chosen by ``selection`` from their sites at :math:`q_{t+1}`; the data of
the others is dropped and their sites stay, frozen. :func:`keep_memory` chooses the memory of
data already held (e.g. the first task's, after :func:`~numpyro_pc.posterior.fit`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidOptionError, MissingCapabilityError, UnsupportedModelError
from numpyro_pc.families.registry import GaussianNatural, add_site, remove_site
from numpyro_pc.model.likelihood import ModelData, example_params
from numpyro_pc.model.prediction_matching import with_matching
from numpyro_pc.model.rows import materialise_ids, pad_to_bucket, positions, take_data, to_device
from numpyro_pc.options import MAX_SEED, check_count
from numpyro_pc.protocols.capabilities import NO_CURVATURE, site_curvature
from numpyro_pc.protocols.posterior import Posterior, by_site_table, provides
from numpyro_pc.protocols.records import IterationInfo
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.solvers.expfam import config_rows
from numpyro_pc.sites.gaussian import compute_sites
from numpyro_pc.sites.memory_sets import memory_size, select_memory

from .correction import solve_update

__all__ = ["FunctionMemory", "function_memory", "keep_memory", "kprior_update", "predictions", "new_memory_ids"]

_PREDICTION_BATCH = 256


class FunctionMemory(NamedTuple):
    r"""A posterior's function-space memory: the retained examples and what the K-prior stores of them.

    :ivar ids: the memory examples' ids.
    :ivar data: their rows (:class:`~numpyro_pc.model.terms.ModelData`).
    :ivar predictions: ``(n, k)``: each example's observed-distribution parameters at the posterior
        mean, :math:`\theta_i(m_t)` (the old predictions :math:`\hat y_{i|t}` of the paper, as logits,
        rates or means).
    :ivar sites: their :class:`~numpyro_pc.sites.cached.Sites`.
    """

    ids: np.ndarray
    data: ModelData
    predictions: jax.Array
    sites: Sites


@partial(jax.jit, static_argnums=0)
def _predictions(spec, per_example, shared, mean) -> jax.Array:
    one = lambda ex: example_params(spec, mean, ex, shared)[0]  # noqa: E731
    return jax.lax.map(one, per_example, batch_size=_PREDICTION_BATCH)


def predictions(spec, data, mean) -> jax.Array:
    """``θ_i(mean)`` for every row of ``data``: ``(n, k)`` (bucket-padded, so sizes share compilations)."""
    num = int(data.per_example[0].shape[0])
    if num == 0:
        return jnp.zeros((0, spec.num_params), jnp.result_type(mean))
    padded, _, _ = pad_to_bucket(data, None, np.arange(num), jnp.result_type(mean))
    return _predictions(replace(spec, num_examples=0), tuple(padded.per_example), padded.shared, mean)[:num]


def refuse_local_latents(spec) -> None:
    """Prediction matching compares observed distributions given the global latents; with local latents
    integrated per unit there is no such distribution.

    :raises UnsupportedModelError:
    """
    if spec.local is not None:
        raise UnsupportedModelError(
            f"correction='kprior' matches each memory example's predictive distribution p(y | θ_i(z)); this model's "
            f"units integrate the local latents {list(spec.local.names)}, so an example's observations have no "
            "distribution given the global latents alone. Use correction='memory' (the memory's true losses).")


def _sites(post, spec, data, ids, q) -> Sites:
    padded, weights, padded_ids = pad_to_bucket(data, None, ids, post.state.mean.dtype)
    sites, _ = compute_sites(replace(spec, num_examples=int(padded_ids.size)), padded, post.family, q, post.rule,
                             curvature=post.curvature, storage=post.sites.storage, chunk_size=post.chunk_size,
                             ids=jnp.asarray(padded_ids), weights=weights)
    return sites.take(np.arange(np.asarray(ids).size))


def kprior_update(post, new_data, new_ids, memory_ids, solve_options, raise_on_failure
                  ) -> tuple[object, Sites, list[IterationInfo], GaussianNatural | None, float]:
    """Solve the K-prior update of ``post`` (module docstring) with the memory ``memory_ids``.

    :return: ``(q, sites, history, offset, linearisation_error)``: the sites are the memory's true
        sites at ``q`` followed by the new batch's, with the prior site at ``q``; the error is the
        relative size of what the offset absorbed (module docstring).
    """
    refuse_local_latents(post.spec)
    mean = post.state.mean
    dtype = mean.dtype
    matching = replace(post.spec, matching=True)
    past = take_data(post.data, positions(post.data_ids, memory_ids))
    past_m = with_matching(past, predictions(post.spec, past, mean), jnp.ones(memory_ids.size, dtype))
    # the new rows' loss is their ℓ_i (matched = 0), but the unused branch is differentiated too: real old
    # predictions keep it finite (zeros could put a scale at 0)
    new_m = with_matching(new_data, predictions(post.spec, new_data, mean), jnp.zeros(new_ids.size, dtype))
    if memory_ids.size == 0:
        q, fresh, history, offset = solve_update(post, new_m, new_ids, memory_ids, True, 1.0, solve_options,
                                                 raise_on_failure, spec=matching, past=past_m, replaces_sites=False)
        return q, fresh, history, offset, 0.0
    kappa_old = _sites(post, matching, past_m, memory_ids, post.state)
    q, fresh, history, offset = solve_update(post, new_m, new_ids, memory_ids, True, 1.0, solve_options,
                                             raise_on_failure, stale=kappa_old, spec=matching, past=past_m,
                                             replaces_sites=False)
    family = post.family
    kappa_new = fresh.take(np.arange(memory_ids.size))
    true_new = _sites(post, post.spec, past, memory_ids, q)
    true_old = post.sites.take(positions(post.sites.ids, memory_ids))
    old_sum = true_old.natural_sum(family)
    unmatched = remove_site(add_site(old_sum, kappa_new.natural_sum(family)),
                            add_site(kappa_old.natural_sum(family), true_new.natural_sum(family)))
    offset = unmatched if offset is None else add_site(offset, unmatched)
    scale = max(_size(old_sum), 1e-300)
    sites = true_new.concat(fresh.take(np.arange(memory_ids.size, memory_ids.size + new_ids.size)),
                            prior_from="other")
    return q, sites, history, offset, _size(unmatched) / scale


def _size(natural) -> float:
    return float(max(float(jnp.max(jnp.abs(leaf))) if jnp.size(leaf) else 0.0 for leaf in jax.tree.leaves(natural)))


def new_memory_ids(post, new_ids, memory, selection, seed) -> np.ndarray:
    """The new batch's examples that join the function-space memory: ``memory`` of them (``None``: all),
    chosen by ``selection`` from their sites in ``post`` (the posterior after the update)."""
    if memory is None:
        return np.asarray(new_ids)
    return select_memory(post, memory_size(memory, int(np.asarray(new_ids).size)), selection, seed,
                         candidates=np.asarray(new_ids))


def check_kprior_memory(memory, selection, num_new, family) -> None:
    """``memory`` of a K-prior update is a size (a count or a fraction of the new batch), or ``None`` (all of
    it); ``selection`` chooses that many. Checked before the solve.

    :raises InvalidOptionError: ids, a set or an iterator given as ``memory``; a size :func:`memory_size`
        refuses; a ``selection`` other than ``"random"`` without a size to choose.
    :raises MissingCapabilityError: a selection by curvature or leverage for a family whose sites carry none.
    """
    memory = materialise_ids(memory)
    if memory is not None and np.ndim(memory) != 0:
        raise InvalidOptionError("with correction='kprior', memory= is how many of the new batch's examples join the "
                                 "function-space memory (a count, or a fraction of the batch); every retained example "
                                 f"is already matched. Got ids ({np.size(memory)} of them); use keep_memory(...) to "
                                 "choose which retained examples stay.")
    if memory is None:
        if selection != "random":
            raise InvalidOptionError(f"selection={selection!r} chooses a memory of a given size; with memory=None every "
                                     "example of the new batch joins the function-space memory")
        return
    memory_size(memory, num_new)
    if selection in ("curvature", "leverage") and site_curvature(family).detail == NO_CURVATURE:
        raise MissingCapabilityError(f"selection={selection!r} ranks examples by the precision Ĥ_i their sites carry; "
                                     f"the {family.name} family's sites carry gradients only. Use selection='residual' "
                                     "or 'random'")


@provides("keep_memory")
def keep_memory(post, size, selection="random", seed=0) -> Posterior:
    """Reduce the data ``post`` retains to a function-space memory of ``size`` examples.

    The sites are unchanged: the dropped examples stay in the posterior, frozen, and a later
    ``update(..., correction="kprior")`` matches only the memory.

    :param size: a count, or a fraction in ``(0, 1]`` of the retained examples.
    :param str selection: ``"random"``, ``"residual"``, ``"curvature"`` or ``"leverage"``
        (:mod:`numpyro_pc.sites.memory_sets`; an exponential-family posterior ranks by ``"random"`` or
        ``"leverage"``).
    :param int seed: the seed of ``"random"``.
    :return: the posterior with the memory's data only.
    """
    check_count(seed, "seed", minimum=0, allow_none=False, maximum=MAX_SEED)
    retained = np.asarray(post.data_ids)
    kept = select_memory(post, memory_size(size, retained.size), selection, seed)
    return _with_rows(post, positions(retained, kept), kept).evolve(record=None)


_with_rows = by_site_table("keep_memory")  # a posterior holding only some of its rows' data


@_with_rows.register(Sites)
def _gaussian_rows(post, rows, kept) -> Posterior:
    return post.evolve(data=take_data(post.data, rows), data_ids=to_device(kept),
                       spec=replace(post.spec, num_examples=int(kept.size)))


@_with_rows.register(EFSiteTable)
def _product_rows(post, rows, kept) -> Posterior:
    return post.evolve(config=config_rows(post.config, int(kept.size)), data=take_data(post.data, rows),
                       data_ids=to_device(kept.astype(np.asarray(post.ids).dtype)))


@provides("memory")
def function_memory(post) -> FunctionMemory:
    """``post``'s function-space memory (:class:`FunctionMemory`): its retained examples, their
    predictions at the mean and their sites."""
    ids = np.asarray(post.data_ids)
    return FunctionMemory(ids=ids, data=post.data, predictions=_predictions_at_mean(post),
                          sites=post.sites.take(positions(post.sites.ids, ids)))


_predictions_at_mean = by_site_table("memory")


@_predictions_at_mean.register(Sites)
def _gaussian_predictions(post) -> jax.Array:
    refuse_local_latents(post.spec)
    return predictions(post.spec, post.data, post.state.mean)


@_predictions_at_mean.register(EFSiteTable)
def _product_predictions(post) -> jax.Array:
    z, discrete, _ = post.model_point(post.point_of(post.mean))
    if discrete:
        raise MissingCapabilityError(f"the memory's predictions are the observed distributions' parameters at one "
                                     f"value of the latents; the discrete latents {sorted(discrete)} have a mean that "
                                     "is none of their values")
    return predictions(post.spec, post.data, z)
