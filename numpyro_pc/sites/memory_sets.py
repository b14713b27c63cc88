r"""Which past examples an update corrects: one rule for every family (paper §3.1, eq. ``postcorr``).

An update replaces the stale sites of a set :math:`C` of retained examples by their true
losses. :func:`corrected_ids` turns the user's ``correction`` / ``memory`` / ``selection``
into :math:`C`, the same way for a Gaussian and an exponential-family posterior:

- ``memory`` is a count of examples (an integer, or a whole float above 1), a fraction in
  :math:`(0, 1]` of the retained examples (rounded, at least one; ``1.0`` is all of them), or a
  list of example ids;
- ``selection`` ranks the retained examples when ``memory`` is a size: ``"random"`` (drawn
  with ``seed``) for every family; the other rules score each example's site, and a family
  whose sites carry no such quantity refuses the rule with the reason
  (:func:`selection_scores` dispatches on the family's site table).

Scores, largest first:

``"residual"``
    the Gaussian site's gradient at its expansion point, :math:`\|\hat g_i\|` — how far the
    example is from being explained by the mean.
``"curvature"``
    :math:`\operatorname{tr}\hat H_i`, the precision the site contributes.
``"leverage"``
    the site's share of the posterior in the posterior's own metric: for a Gaussian
    :math:`\operatorname{tr}(\hat H_i S^{-1})`; for an exponential family the second-order
    :math:`\mathrm{KL}(q \,\|\, q_{-i}) \approx \tfrac12 g_i^\top \nabla^2 A(\lambda)\, g_i` of
    removing the site (:math:`\lambda_{-i} = \lambda + g_i`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidOptionError, MissingCapabilityError
from numpyro_pc.model.rows import as_ids, materialise_ids, positions
from numpyro_pc.options import is_choice
from numpyro_pc.protocols.capabilities import NO_CURVATURE, site_curvature
from numpyro_pc.protocols.posterior import by_site_table

from .expfam_table import EFSiteTable
from .gaussian import Sites

__all__ = ["CORRECTIONS", "SELECTIONS", "MEMORY_CORRECTIONS", "memory_size", "selection_scores", "select_memory",
           "corrected_ids", "check_stochastic_options"]

CORRECTIONS = ("none", "prior", "exact", "memory", "weighted", "stochastic", "kprior")
MEMORY_CORRECTIONS = ("memory", "weighted")  # the corrections that take memory=
SELECTIONS = ("random", "residual", "curvature", "leverage")


def memory_size(memory, num_retained: int) -> int:
    """The number of retained examples a scalar ``memory`` asks for.

    :param memory: an integer count; a float in ``(0, 1]`` (a fraction of ``num_retained``, rounded,
        at least one); or a whole float of at least 1 (a count).
    :param int num_retained: the examples whose data is retained.
    :raises InvalidOptionError: a boolean, a negative or non-finite value, or a float above 1 that is
        not whole.
    """
    if isinstance(memory, (bool, np.bool_)):
        raise InvalidOptionError(f"memory must be a count of examples, a fraction in (0, 1] or a list of ids; "
                                 f"got {memory!r}")
    try:
        value = float(memory)
    except (TypeError, ValueError):
        raise InvalidOptionError(f"memory must be a count of examples, a fraction in (0, 1] or a list of ids; "
                                 f"got {memory!r}") from None
    if not np.isfinite(value) or value < 0:
        raise InvalidOptionError(f"memory must be a count of examples, a fraction in (0, 1] or a list of ids; "
                                 f"got {memory!r}")
    if isinstance(memory, (int, np.integer)):
        return int(memory)
    if 0 < value <= 1:
        return max(1, int(round(value * num_retained)))
    if value != int(value):
        raise InvalidOptionError(f"memory={memory!r} is neither a whole number of examples nor a fraction in (0, 1]")
    return int(value)


_scores = by_site_table("memory selection")  # a family with its own site table registers its scores here


def selection_scores(post, rule: str, rows: np.ndarray) -> np.ndarray:
    """Score of each retained example under ``rule`` (largest first is chosen).

    :param post: the posterior.
    :param str rule: ``"residual"``, ``"curvature"`` or ``"leverage"`` (module docstring).
    :param rows: positions in ``post.sites`` of the retained examples.
    :return: a NumPy array, one score per row.
    :raises MissingCapabilityError: a rule the family's sites carry nothing for, with the reason.
    """
    return _scores(post, rule, rows)


@_scores.register(Sites)
def _gaussian_scores(post, rule: str, rows: np.ndarray) -> np.ndarray:
    sites = post.sites.take(rows)
    if rule == "residual":
        return np.asarray(jnp.linalg.norm(sites.grad, axis=1))
    if site_curvature(post.family).detail == NO_CURVATURE:
        raise MissingCapabilityError(f"selection={rule!r} ranks examples by the precision Ĥ_i their sites carry; "
                                     f"the {post.family.name} family's sites carry gradients only (its precision "
                                     "is a fixed base measure). Use selection='residual' or 'random'")
    if rule == "curvature":
        return np.asarray(sites.curvature_trace())
    return np.asarray(sites.curv.trace_quad(post.covariance, jnp.zeros_like(sites.dense_grad()))[0])


@_scores.register(EFSiteTable)
def _ef_scores(post, rule: str, rows: np.ndarray) -> np.ndarray:
    if rule != "leverage":
        why = ("a Gaussian site's gradient at its expansion point; an exponential-family site is the natural-"
               "parameter vector λ̂_i = -g_i, whose size depends on the parametrisation, not on the fit"
               if rule == "residual" else
               "a Gaussian site's precision Ĥ_i; an exponential-family site is one natural-parameter vector, "
               "without a separate curvature")
        raise MissingCapabilityError(f"selection={rule!r} ranks examples by {why}. Use selection='leverage' "
                                     "(the KL of removing each site) or 'random'")
    grads = post.sites.take(rows).grads
    fisher = post.family.fisher(post.natural)
    return np.asarray(0.5 * jnp.einsum("ip,pq,iq->i", grads, fisher, grads))


def select_memory(post, size: int, rule: str = "random", seed: int = 0, candidates=None) -> np.ndarray:
    """Choose ``size`` retained examples to correct.

    :param post: the posterior.
    :param int size: how many (clipped to the candidates).
    :param str rule: one of :data:`SELECTIONS` (module docstring).
    :param int seed: the seed of ``"random"``.
    :param candidates: the ids to choose from, examples with a site (default: the retained examples).
    :return: the chosen ids, increasing.
    :raises InvalidOptionError: an unknown rule.
    :raises MissingCapabilityError: a rule the family's sites carry nothing for.
    """
    if not is_choice(rule, SELECTIONS):
        raise InvalidOptionError(f"unknown selection rule {rule!r}; expected one of {SELECTIONS}")
    ids = np.asarray(post.data_ids if candidates is None else candidates)
    size = int(min(max(size, 0), ids.size))
    if size == 0:
        return ids[:0]
    if rule == "random":
        chosen = np.random.default_rng(seed).choice(ids.size, size=size, replace=False)
        return ids[np.sort(chosen)]
    score = selection_scores(post, rule, positions(post.sites.ids, ids))
    if not np.all(np.isfinite(score)):
        raise InvalidOptionError(f"selection={rule!r} scored {int(np.sum(~np.isfinite(score)))} example(s) as "
                                 "non-finite: the posterior's sites are not finite; refit it")
    return ids[np.sort(np.argsort(-score, kind="stable")[:size])]


def corrected_ids(post, correction: str, memory, selection: str, seed: int) -> tuple[np.ndarray, bool]:
    """The ids :math:`C` whose stale sites ``correction`` replaces, and whether the prior term is corrected.

    :param post: the posterior.
    :param str correction: one of :data:`CORRECTIONS`.
    :param memory: for ``"memory"`` and ``"weighted"``: a size or a list of ids (module docstring);
        for ``"kprior"`` the new batch's share of the memory (not used here: every retained example is
        corrected); ``None`` otherwise.
    :param str selection: the rule choosing a memory of a given size.
    :param int seed: the seed of random selection.
    :return: ``(ids, correct_prior)``.
    :raises InvalidOptionError: an unknown correction, ``memory`` missing where it is needed or given
        where it is not used.
    :raises UnknownExampleError: memory ids that are not retained examples.
    """
    if not is_choice(correction, CORRECTIONS):
        raise InvalidOptionError(f"unknown correction {correction!r}; expected one of {CORRECTIONS}")
    uses_memory = correction in MEMORY_CORRECTIONS
    memory = materialise_ids(memory)  # a set or an iterator of ids is ids, not a size
    if correction == "kprior":  # memory= sizes the new batch's part of the memory; every retained one is matched
        if not is_choice(selection, SELECTIONS):
            raise InvalidOptionError(f"unknown selection rule {selection!r}; expected one of {SELECTIONS}")
        return np.asarray(post.data_ids), True
    if (memory is not None) != uses_memory:
        raise InvalidOptionError(f"memory= goes with correction='memory' or 'weighted' (and they need it); got "
                                 f"correction={correction!r} with memory={'None' if memory is None else 'given'}")
    if not is_choice(selection, SELECTIONS):
        raise InvalidOptionError(f"unknown selection rule {selection!r}; expected one of {SELECTIONS}")
    if selection != "random" and not (uses_memory and np.ndim(memory) == 0):
        raise InvalidOptionError(f"selection={selection!r} chooses a memory of a given size (correction='memory' or "
                                 "'weighted' with memory a count or a fraction); here nothing is chosen "
                                 f"(correction={correction!r}, memory {'of ids' if uses_memory else 'unused'})")
    retained = np.asarray(post.data_ids)
    if correction in ("none", "prior"):
        return retained[:0], correction == "prior"
    if correction in ("exact", "stochastic"):
        return retained, True
    if np.ndim(memory) == 0:
        return select_memory(post, memory_size(memory, retained.size), selection, seed), True
    chosen = as_ids(memory)
    positions(retained, chosen, "retained example (its data was not kept)")
    return chosen, True


def check_stochastic_options(correction: str, epochs) -> None:
    """Refuse ``epochs`` given to a correction other than ``"stochastic"`` (the only one that makes passes).

    :raises InvalidOptionError:
    """
    if epochs is not None and correction != "stochastic":
        raise InvalidOptionError(f"epochs= caps the passes of correction='stochastic'; got epochs={epochs!r} with "
                                 f"correction={correction!r}")
