r"""Change the prior of a fitted posterior without refitting (the K-prior paper's third task).

A fitted posterior :math:`q_t \propto \exp(-\hat\ell_{0|t}) \prod_i \exp(-\hat\ell_{i|t})` holds the
old prior :math:`p_0` as one site. With a new prior :math:`p_0'` and the same likelihood the target
is :math:`q_* = \arg\min_q E_q[\ell_0' + \sum_i \ell_i] - H(q)`; in the dual form it is the
update of paper eq. ``postcorr`` with no new example and the prior term replaced,

.. math::

    q_{t+1} = \arg\min_q\; E_q[\ell_0'] + \mathrm{KL}(q \,\|\, q_t) - E_q[\hat\ell_{0|t}]
        + \sum_{i \in C} E_q\big[\ell_i - \hat\ell_{i|t}\big]:

the old prior site is divided out of :math:`q_t`, the new prior enters live, and the examples in
:math:`C` are corrected — every retained one (``"exact"``: the fixed point is the batch fit
under the new prior), a memory of them (``"memory"``), the memory matched in function space
without labels (``"kprior"``, :mod:`numpyro_pc.ops.kprior`: the K-prior of Khan & Swaroop 2021,
whose "change the regulariser" task this is), or none (``"prior"``: the data's sites are kept
as they were, exact when they do not depend on :math:`q`, e.g. a linear-Gaussian likelihood with
a Gaussian family).

The new prior comes as another model whose likelihood is the fitted one (checked at probe
points around the posterior), or as new values of the fitted model's fixed arguments
(``post.change_prior(prior_precision=1.0)``). The posterior returned is bound to the new model:
it saves and loads with it, and later updates use its prior.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidOptionError, ModelMismatchError, PosteriorCorrectionError
from numpyro_pc.model.likelihood import ModelData, bind_model
from numpyro_pc.model.rows import positions, stand_in_row, take_data
from numpyro_pc.model.terms import is_array
from numpyro_pc.options import MAX_SEED, check_count, check_flag, check_solver_options
from numpyro_pc.protocols.posterior import Posterior, by_site_table, provides
from numpyro_pc.protocols.records import UpdateInfo
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.expfam import conjugate_rtol, prior_form_residual
from numpyro_pc.sites.expfam_table import EFSiteTable, EFState
from numpyro_pc.solvers.expfam import bucketed_target, solve_every_site
from numpyro_pc.sites.memory_sets import corrected_ids

from numpyro_pc.dual.expfam_adapt import KPRIOR_REFUSAL, solve_with_rows_live, split_frozen

from .correction import check_sites_represent, solve_update
from .handlers import check_terms_agree, latent_layout
from .kprior import kprior_update

__all__ = ["PRIOR_CORRECTIONS", "change_prior", "rebind_prior"]

#: The corrections a prior change accepts (``update``'s names; the prior term is always live).
PRIOR_CORRECTIONS = ("exact", "memory", "kprior", "prior")


def _dtype(post) -> np.dtype:
    return np.result_type(*(leaf.dtype for leaf in jax.tree.leaves(post.q)))


def _first_row(post) -> ModelData:
    """The first retained example, or a row of zeros shaped like one when no data is retained."""
    return take_data(post.data, np.zeros(1, np.int64)) if post.num_retained else stand_in_row(post.data)


def _call_arguments(post, model, fixed) -> tuple[tuple, dict, tuple]:
    """The fitted call of ``model`` on the first retained example, with the fixed arguments ``fixed`` replaced;
    and the names of the array arguments that are not per-example."""
    spec = post.spec
    first = _first_row(post)
    args, kwargs = spec.build_args(first.per_example, first.shared)
    kinds = {name.split("[")[0]: kind for name, kind in zip(spec.arg_names, spec.kinds)}
    shared = {name for name, kind in kinds.items() if kind == "shared"}
    if not fixed:
        return args, kwargs, tuple(sorted(shared))
    try:
        signature = inspect.signature(model)
        signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise ModelMismatchError(f"the model cannot be called like the posterior's model: {err}") from err
    # a replaced argument keeps the place it was passed in (by position or keyword), and a new one goes by keyword:
    # later batches are passed that way, and the binding compares the call's structure
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
    args = list(args)
    for name, value in fixed.items():
        if name not in signature.parameters and not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            raise InvalidOptionError(f"change_prior got {name}={value!r}, but the model takes no argument {name!r}; "
                                     f"its arguments are {list(signature.parameters)}")
        if kinds.get(name) == "example":
            raise InvalidOptionError(f"{name!r} is per-example data of the fitted model; a prior change keeps the data "
                                     "(add or remove examples with update() or delete())")
        if is_array(value) and np.ndim(value) >= 1:
            shared.add(name)
        if name in positional:
            args[positional.index(name)] = value
        else:
            kwargs[name] = value
    return tuple(args), dict(kwargs), tuple(sorted(shared))


def rebind_prior(post, model=None, **fixed) -> tuple[object, ModelData]:
    """``post``'s retained data bound to ``model`` (the posterior's own if ``None``) called with the fitted
    arguments, the fixed arguments in ``fixed`` replaced; checked to be the fitted model up to its prior.

    :return: ``(spec, data)``: the new binding for every retained row.
    :raises ModelMismatchError: other latent or observed sites, other per-example arguments, or a likelihood that
        differs from the fitted one at a probe point around the posterior.
    :raises InvalidOptionError: a fixed argument the model does not take or that is per-example data.

    The likelihoods are compared on the first retained example (on a row of zeros when no data is retained).
    """
    spec = post.spec
    model = spec.model if model is None else model
    if not callable(model):
        raise InvalidOptionError(f"change_prior needs a NumPyro model (a callable); got {type(model).__name__}")
    args, kwargs, shared = _call_arguments(post, model, fixed)
    try:
        other, one = bind_model(model, args, kwargs, data_plate=spec.plate, shared=shared,
                                allow_discrete=bool(spec.latent.discrete_names))
    except PosteriorCorrectionError as err:
        raise ModelMismatchError(f"the model cannot be called like the posterior's model: {err}") from err
    ours, theirs = latent_layout(spec), latent_layout(other)
    if ours != theirs or tuple(other.observed) != tuple(spec.observed):
        raise ModelMismatchError(f"a prior change keeps the latent and observed sites: the model has latent {theirs} and "
                                 f"observed {list(other.observed)}, the posterior {ours} and {list(spec.observed)}")
    per_example = [n for n, k in zip(spec.arg_names, spec.kinds) if k == "example"]
    if [n for n, k in zip(other.arg_names, other.kinds) if k == "example"] != per_example:
        raise ModelMismatchError("the model reads other per-example arguments than the fitted one: "
                                 f"{[n for n, k in zip(other.arg_names, other.kinds) if k == 'example']} vs {per_example}")
    first = _first_row(post)
    rtol = 1e-8 if _dtype(post) == np.float64 else 1e-4
    check_terms_agree(spec, other, first, one, post.probe_points(3), rtol, "a probe point", terms=("likelihood",))
    return replace(other, num_examples=spec.num_examples), ModelData(post.data.per_example, one.shared)


def _check_options(correction, memory, selection, seed, tol, max_iters, progress, raise_on_failure) -> None:
    if not isinstance(correction, str) or correction not in PRIOR_CORRECTIONS:
        raise InvalidOptionError(f"change_prior takes correction in {PRIOR_CORRECTIONS}; got {correction!r}"
                                 + (" (the new prior is always corrected: 'prior' keeps every data site as it is)"
                                    if correction == "none" else ""))
    if correction == "kprior" and memory is not None:
        raise InvalidOptionError("correction='kprior' matches every retained example (the function-space memory); "
                                 "choose its size before with keep_memory(size, selection), not memory=")
    check_solver_options(tol, max_iters)
    check_count(seed, "seed", minimum=0, allow_none=False, maximum=MAX_SEED)
    check_flag(progress, "progress")
    check_flag(raise_on_failure, "raise_on_failure")


@provides("change_prior")
def change_prior(post, model=None, *, correction: str = "exact", memory=None, selection: str = "random", seed: int = 0,
                 tol: float | None = None, max_iters: int | None = None, progress: bool = False,
                 raise_on_failure: bool = True, **fixed) -> Posterior:
    r"""The posterior of the same data under another prior (module docstring), from ``post`` without a refit.

    :param post: the fitted posterior (at its fixed point).
    :param model: a model with the fitted likelihood and a new prior (``None``: the posterior's model, with
        ``fixed`` arguments changed).
    :param str correction: ``"exact"`` (every retained example corrected: the batch fit under the new prior when
        every example's data is retained; the sites of dropped data stay as they are),
        ``"memory"`` (``memory`` of them, chosen by ``selection``), ``"kprior"`` (every retained example matched by
        its predictions, no labels read) or ``"prior"`` (no data site recomputed).
    :param memory: for ``"memory"``: a count, a fraction or ids of retained examples.
    :param str selection: how a memory of a given size is chosen (``"random"``, ``"residual"``, …).
    :param int seed: the seed of random selection.
    :param fixed: new values of the model's fixed (non-data) arguments, e.g. ``prior_precision=1.0``.
    :return: the posterior bound to the new model; ``record`` is an
        :class:`~numpyro_pc.protocols.records.UpdateInfo` with ``operation="change_prior"`` and ``new=0``.
    :raises ModelMismatchError: a model whose likelihood or latent sites differ from the fitted one's.
    :raises InvalidOptionError: an unknown correction or argument.
    :raises ConvergenceError: the solver missed its tolerance (with ``raise_on_failure``).
    """
    _check_options(correction, memory, selection, seed, tol, max_iters, progress, raise_on_failure)
    return _change_prior(post, model, correction, memory, selection, seed,
                         dict(tol=tol, max_iters=max_iters, progress=progress), raise_on_failure, fixed)


_change_prior = by_site_table("change_prior")


@_change_prior.register(Sites)
def _change_gaussian_prior(post, model, correction, memory, selection, seed, solve_options, raise_on_failure,
                           fixed) -> Posterior:
    with jax.enable_x64(_dtype(post) == np.float64):
        return _solve_gaussian(post, model, correction, memory, selection, seed, solve_options, raise_on_failure, fixed)


def _solve_gaussian(post, model, correction, memory, selection, seed, solve_options, raise_on_failure,
                    fixed) -> Posterior:
    start = time.perf_counter()
    check_sites_represent(post, "a prior change", stacklevel=5)
    spec, data = rebind_prior(post, model, **fixed)
    rebound = post.evolve(spec=spec, data=data)
    corrected, _ = corrected_ids(rebound, correction, memory, selection, seed)
    no_ids = np.zeros(0, np.asarray(post.data_ids).dtype)
    empty = take_data(data, np.zeros(0, np.int64))
    site_rows = positions(post.sites.ids, corrected)
    linearisation_error = None
    if correction == "kprior":
        q, fresh, history, offset, linearisation_error = kprior_update(rebound, empty, no_ids, corrected,
                                                                       solve_options, raise_on_failure)
    else:
        q, fresh, history, offset = solve_update(rebound, empty, no_ids, corrected, True, 1.0, solve_options,
                                                 raise_on_failure, post.sites.take(site_rows))
    held = np.setdiff1d(np.arange(post.num_examples), site_rows)
    sites = post.sites.take(held).concat(fresh, prior_from="other")
    record = UpdateInfo(operation="change_prior", correction=correction, corrected=int(corrected.size), new=0,
                        iterations=len(history) - 1, kl_to_previous=float(post.family.kl(q, post.state)), weight=1.0,
                        past_examples_touched=int(corrected.size * (len(history) - 1)),
                        reused_sites=int(history[0].reused_sites or 0), restart=history[0].restart,
                        seconds=time.perf_counter() - start,
                        memory=post.num_retained if correction == "kprior" else None,
                        linearisation_error=linearisation_error)
    return rebound.evolve(state=q, sites=sites, history=history, record=record, offset=offset,
                          stale_sites=post.stale_sites and correction != "exact")


@_change_prior.register(EFSiteTable)
def _change_ef_prior(post, model, correction, memory, selection, seed, solve_options, raise_on_failure,
                     fixed) -> Posterior:
    if correction == "kprior":
        raise InvalidOptionError(KPRIOR_REFUSAL)
    with jax.enable_x64(_dtype(post) == np.float64):
        return _solve_ef(post, model, correction, memory, selection, seed, solve_options, raise_on_failure, fixed)


def _solve_ef(post, model, correction, memory, selection, seed, solve_options, raise_on_failure, fixed) -> Posterior:
    """The exponential-family prior change: the old prior term divided out of ``λ_t`` and the new one live. A
    conjugate-form new prior (tested as :func:`~numpyro_pc.dual.expfam_fit.fit_ef` does) is flagged so afterwards."""
    start = time.perf_counter()
    spec, data = rebind_prior(post, model, **fixed)
    config = replace(post.config, spec=spec)
    # the old sites and λ_t with the new binding: what is divided out is the old prior, what is live the new one
    rebound = post.evolve(config=config, data=data, conjugate_prior=False)
    _, at_start = bucketed_target(config, data, True, jnp.zeros_like(post.natural))(post.natural)
    conjugate = bool(prior_form_residual(config, post.natural, data, at_start) < conjugate_rtol(post.natural.dtype))
    corrected, _ = corrected_ids(rebound, correction, memory, selection, seed)
    tol, max_iters, progress = solve_options["tol"], solve_options["max_iters"], solve_options["progress"]
    if correction == "exact":
        _, frozen = split_frozen(post)
        solved = solve_every_site(rebound, data, post.data_ids, post.natural, tol, max_iters, raise_on_failure,
                                  progress, frozen=post.sites.take(frozen))
        lam, table, fields = solved.natural, solved.sites, solved.record.solve_fields()
    else:
        rows = positions(post.ids, corrected) if corrected.size else np.zeros(0, np.int64)
        active = take_data(data, positions(post.data_ids, corrected) if corrected.size else np.zeros(0, np.int64))
        lam, sites, info = solve_with_rows_live(rebound, rows, active, True, tol, max_iters, raise_on_failure, progress)
        table = replace(post.sites.with_rows(rows, sites.grads[:rows.size]), prior=sites.prior)
        fields = info._asdict()
    record = UpdateInfo(operation="change_prior", correction=correction, corrected=int(corrected.size), new=0,
                        kl_to_previous=float(post.family.kl(lam, post.natural)),
                        seconds=time.perf_counter() - start, **fields)
    return rebound.evolve(state=EFState(lam, table), conjugate_prior=conjugate, record=record,
                          stale_sites=bool(post.stale_sites) and correction != "exact")
