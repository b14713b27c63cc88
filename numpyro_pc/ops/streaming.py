r"""Streaming updates of a dual-form posterior with correction terms (paper §3.1; docs/adapting.md, "Adding data").

Given ``q_t`` with its sites and a new batch, the corrected update is

.. math::

    q_{t+1} = \arg\min_q\; E_q[\ell_{new}] + KL(q \| q_t) + \sum_{i \in C} E_q[\ell_i - \hat\ell_{i|t}],

which is the dual-form problem with the *cavity* ``q_t / Π_{i∈C} exp(−ℓ̂_{i|t})`` as a
fixed Gaussian factor and the true losses of the new examples and of ``C`` as live terms
(paper eq. ``postcorr``). The policy chooses ``C``:

``"none"``
    ``C = ∅`` — variational continual learning (VCL).
``"prior"``
    ``C = {0}`` — the prior site only.
``"exact"``
    every retained example and the prior — the batch posterior.
``"memory"``
    the prior and a memory of retained examples (ids, or a size and a selection rule:
    ``random``, ``residual``, ``curvature``, ``leverage``).
``"weighted"``
    the memory's corrections scaled by ``n_retained / n_memory`` so that they stand for
    all retained data; if that makes the problem unsolvable the update falls back to
    ``"memory"`` and says so (``record["fallback"]``).
``"stochastic"``
    the exact correction from a fresh random subset of the retained data at every
    iteration (stochastic average gradient, SAG): a table holds the latest site of every
    retained example, only the subset's rows are recomputed, and each natural-gradient
    step uses the table's sums — exact once every row is fresh, so the iteration
    converges to the ``"exact"`` answer while touching one subset per step (full family).

``"kprior"``
    every retained example (the function-space memory) and the prior, matched without labels:
    each memory example's loss is the KL from its old predictive distribution to the new one
    (:mod:`numpyro_pc.ops.kprior`; the K-prior with the isotropic family); ``memory`` examples of
    the new batch (a count or a fraction, chosen by ``selection``; ``None``: all) join the memory.

Sites of examples outside ``C`` stay as they were (stale); the result still satisfies
``λ_{t+1} = Σ_i λ̂_i`` over all sites.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import numpy as np

from numpyro_pc.errors import ConvergenceError, NotPositiveDefiniteError
from numpyro_pc.model.batches import bind_batch
from numpyro_pc.model.rows import check_keep, concat_data, positions, retain, take_data, to_device
from numpyro_pc.protocols.posterior import Posterior, provides
from numpyro_pc.protocols.records import CorrectionMagnitude, UpdateInfo
from numpyro_pc.sites.memory_sets import CORRECTIONS, SELECTIONS, check_stochastic_options, corrected_ids, select_memory

from .correction import check_sites_represent, solve_update
from .diagnostics import site_mismatch
from .kprior import check_kprior_memory, kprior_update, new_memory_ids
from .stochastic import stochastic_update

__all__ = ["CORRECTIONS", "SELECTIONS", "update", "select_memory", "concat_data", "take_data"]


@provides("update")
def update(post, *args, correction="exact", memory=None, selection="random", keep="all", seed=0, tol=None,
           max_iters=None, progress=False, raise_on_failure=True, batch_fraction=0.1, epochs=None, **kwargs) -> Posterior:
    """Add a batch of examples to ``post`` (see :meth:`numpyro_pc.DualPosterior.update`)."""
    start = time.perf_counter()
    check_keep(keep)
    check_sites_represent(post, "an update", stacklevel=3)  # the sites' own identity: an exact update recomputes stale ones
    new_data = bind_batch(post, args, kwargs)
    num_new = int(new_data.per_example[0].shape[0])
    new_ids = np.arange(post.next_id, post.next_id + num_new, dtype=np.int64)
    corrected, correct_prior = corrected_ids(post, correction, memory, selection, seed)
    check_stochastic_options(correction, epochs)
    site_rows = positions(post.sites.ids, corrected)
    weight = 1.0
    if correction == "weighted":
        weight = post.num_retained / max(corrected.size, 1)
    solve_options = dict(tol=tol, max_iters=max_iters, progress=progress)
    fallback = None
    linearisation_error = None
    if correction == "kprior":
        check_kprior_memory(memory, selection, num_new, post.family)
        q, fresh, history, offset, linearisation_error = kprior_update(post, new_data, new_ids, corrected,
                                                                       solve_options, raise_on_failure)
        stale = post.sites.take(site_rows)
        touched = corrected.size * (len(history) - 1)
    elif correction == "stochastic":

        q, fresh, history, touched = stochastic_update(post, new_data, new_ids, corrected, batch_fraction, seed,
                                                       solve_options, raise_on_failure, epochs)
        offset = post.offset
    else:
        stale = post.sites.take(site_rows)
        try:
            q, fresh, history, offset = solve_update(post, new_data, new_ids, corrected, correct_prior, weight,
                                                      solve_options, raise_on_failure or weight != 1.0, stale)
        except (ConvergenceError, NotPositiveDefiniteError) as err:
            if weight == 1.0:
                raise
            fallback = f"weighted correction failed ({type(err).__name__}); fell back to the unweighted memory"
            warnings.warn(fallback, RuntimeWarning, stacklevel=3)
            q, fresh, history, offset = solve_update(post, new_data, new_ids, corrected, correct_prior, 1.0,
                                                      solve_options, raise_on_failure, stale)
        touched = corrected.size * (len(history) - 1)

    stale_rows = np.setdiff1d(np.arange(post.num_examples), site_rows)
    sites = post.sites.take(stale_rows).concat(fresh, prior_from="other" if correct_prior else "self")
    kept_new = new_ids
    if correction == "kprior" and memory is not None:  # the new batch's share of the memory, scored at q_{t+1}
        scored = post.evolve(state=q, sites=sites)  # scores read the sites and q only (candidates: the new ids)
        kept_new = new_memory_ids(scored, new_ids, memory, selection, seed)
    data, data_ids = retain(post.data, post.data_ids, take_data(new_data, positions(new_ids, kept_new)), kept_new,
                            keep, int(post.next_id) - len(post.tombstones), seed)
    magnitude = None
    if corrected.size and correction != "stochastic":
        # bucket-padded (rows beyond the corrected ones are dropped): the jitted diagnostic compiles once per bucket
        mismatch = site_mismatch(stale.bucketed()[0], fresh.take(np.arange(corrected.size)).bucketed()[0], q,
                                 post.family, post.spec.affine)[0]
        mismatch = np.asarray(mismatch)[:corrected.size]
        magnitude = CorrectionMagnitude(ids=corrected, magnitude=mismatch, total=float(np.sum(mismatch)))
    record = UpdateInfo(correction=correction, corrected=int(corrected.size), new=num_new,
                        iterations=len(history) - 1, kl_to_previous=float(post.family.kl(q, post.state)),
                        weight=weight, fallback=fallback, past_examples_touched=int(touched),
                        reused_sites=int(history[0].reused_sites or 0), restart=history[0].restart,
                        correction_magnitude=magnitude, seconds=time.perf_counter() - start,
                        batch_fraction=float(batch_fraction) if correction == "stochastic" else None,
                        epochs=epochs if correction == "stochastic" else None,
                        memory=int(np.asarray(data_ids).size) if correction == "kprior" else None,
                        linearisation_error=linearisation_error)
    return post.evolve(spec=replace(post.spec, num_examples=int(np.asarray(data_ids).size)), data=data,
                         data_ids=to_device(data_ids), state=q, sites=sites, history=history,
                         next_id=post.next_id + num_new, record=record, offset=offset,
                         # an exact correction recomputes every retained site; the others keep the stale ones stale
                         stale_sites=post.stale_sites and correction != "exact")
