r"""Building a Gaussian dual-form posterior from a start: its sites computed and, on request,
solved to the fixed point (paper eq. ``qdualform``), with the Monte Carlo error of the
expectations measured on independent draws.

:func:`build_posterior` is the one constructor behind :func:`numpyro_pc.fit`,
:func:`numpyro_pc.dual_form`, merging, the federated run and the pure streaming kernels'
export.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np

from numpyro_pc.errors import MonteCarloErrorWarning
from numpyro_pc.model.rows import pad_to_bucket, to_device
from numpyro_pc.protocols.capabilities import needs_dense_sum
from numpyro_pc.protocols.records import ExpectationError, FitInfo
from numpyro_pc.sites.expectations import prepare_rule
from numpyro_pc.sites.gaussian import mc_along_subspace
from numpyro_pc.solvers.gaussian import default_tol
from numpyro_pc.solvers.site_problem import SiteProblem, dual_residual

from .base import DualPosteriorBase

__all__ = ["build_posterior"]


def build_posterior(spec, data, family, q, rule, curvature, storage, chunk_size, guide, refine, tol, max_iters,
                    progress, raise_on_failure, cls=None, operation="fit") -> DualPosteriorBase:
    """A posterior of ``q`` (an instance of ``cls``, default :class:`DualPosteriorBase`): sites computed
    for ``data`` and, with ``refine``, solved to the fixed point.

    The constructor shared by :func:`fit`, :func:`dual_form`, merging and the federated run; the
    data are padded to a bucket internally and the result holds one site per real example. Its
    ``record`` is a :class:`~numpyro_pc.protocols.records.FitInfo` naming ``operation``.
    """
    rule = prepare_rule(rule, spec, data, q.mean)
    if rule.kind == "mc" and rule.subspace_dim and not mc_along_subspace(rule, curvature):
        rule = replace(rule, subspace_dim=0)  # Gauss–Newton or the reparameterisation estimator: dense, say so
    num = spec.num_examples
    padded, weights, ids = pad_to_bucket(data, None, np.arange(num), q.mean.dtype)
    problem = SiteProblem(replace(spec, num_examples=int(ids.size)), padded, family, rule, curvature, storage,
                          chunk_size, to_device(ids), None, True, weights)
    sites, sums = problem.sites(q, need_hessian_sum=needs_dense_sum(family, q.mean.shape[0]))
    cls = DualPosteriorBase if cls is None else cls
    post = cls(spec, data, family, q, sites.take(np.arange(num)), rule, curvature, storage, chunk_size, (), guide)
    if not refine:
        return post.evolve(record=FitInfo(operation=operation))
    # the solver starts from the sites just computed
    post = post.refine(tol=tol, max_iters=max_iters, progress=progress, raise_on_failure=raise_on_failure,
                       _start=(sites, sums))
    record = FitInfo(operation=operation, **post.record.solve_fields())
    if rule.kind == "mc":
        record = record.replace(expectation_error=_monte_carlo_error(post, problem, num))
    return post.evolve(record=record)


def _monte_carlo_error(post, problem, num) -> ExpectationError:
    """The dual-form residual of the posterior under an independent set of Monte Carlo draws.

    The solver reaches the fixed point of the expectations under *its* fixed draws; the
    residual a second, independent set of draws sees at that point estimates how far the
    answer is from the true variational optimum. Reported in ``record["expectation_error"]``
    and warned about when it is well above the tolerance.
    """
    other = replace(post.rule, seed=post.rule.seed + 1)
    fresh, _ = problem._replace(rule=other).sites(post.state)
    residual = dual_residual(post.family, post.state, fresh.take(np.arange(num)), post.offset)[0]
    tol = default_tol(post.state.mean.dtype)
    if residual > 100 * tol:
        warnings.warn(f"Monte Carlo expectations ({post.rule.num_samples} fixed draws): the fixed point's residual is "
                      f"{post.residual:.1e} for its own draws but {residual:.1e} for independent draws, so the answer is "
                      "only as accurate as the Monte Carlo error; raise num_samples, or use a model whose examples "
                      "have a low-dimensional dependence subspace (expectation='gh').", MonteCarloErrorWarning,
                      stacklevel=4)
    return ExpectationError(independent_draws_residual=float(residual), num_samples=int(post.rule.num_samples))


