r"""Dual-form posteriors in mean-field exponential-family products.

The posterior is a product of one factor per latent site (Beta, Gamma, Dirichlet on the
constrained value; Normal or full Gaussian blocks on the unconstrained value; Bernoulli or
Categorical on a discrete latent; :mod:`numpyro_pc.families.product`), a family member
:math:`q(x) = \exp(\langle\lambda, T(x)\rangle - A(\lambda))` written as its sites
(paper eq. ``qdualform``):

.. math::

    \lambda = -g_0 - \sum_{i=1}^N g_i, \qquad g_i = \nabla_\mu E_q[\ell_i],

held in :class:`EFState` (a pytree; the sites in an
:class:`~numpyro_pc.sites.expfam_table.EFSiteTable`). :class:`EFPosterior` is a thin immutable wrapper:
:func:`~numpyro_pc.dual.expfam_fit.fit_ef` reaches the fixed point from the prior, :func:`~numpyro_pc.dual.expfam_fit.dual_form_ef` from a fitted
hand-written guide; :meth:`EFPosterior.update`, :meth:`~EFPosterior.delete` and
:meth:`~EFPosterior.merge` are the paper's operations in these families (§3.1 streaming with the
exact correction or none, §3.2 deletion by site removal or corrected, Bayesian arithmetic
:math:`\lambda_a + \lambda_b - \lambda_0`). With a conjugate-form prior and likelihood the
sites are exact and constant, so all of these are exact Bayes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Self

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.errors import InvalidOptionError, MissingCapabilityError, MissingMemberError
from numpyro_pc.families.product import (  # noqa: F401  (importable from here, as before)
    ProductFamily,
    family_for_model,
    site_names,
)
from numpyro_pc.guides.expfam import GuideMap, read_guide, write_params
from numpyro_pc.model.terms import local_draws, site_log_likelihoods
from numpyro_pc.options import check_count, check_key, solver_group
from numpyro_pc.protocols.capabilities import SiteCurvature, require
from numpyro_pc.protocols.posterior import Posterior
from numpyro_pc.sites.expfam import EFConfig, compute_sites, model_point  # noqa: F401  (EFConfig: as before)
from numpyro_pc.sites.expfam_eval import inference_data
from numpyro_pc.sites.expfam_table import EFSiteTable, EFState
from numpyro_pc.solvers.expfam import (  # noqa: F401  (blr_solve: importable from here, as before)
    blr_solve, bucketed_target, fixed_part, relative_residual, solve_every_site)
from numpyro_pc.solvers.fixed_point import default_tol

from .expfam_adapt import checked_retained_ids, delete_ef, refine_ef, split_frozen, update_ef

if TYPE_CHECKING:
    from arviz import InferenceData
    from numpyro.distributions import Distribution

    from numpyro_pc.model.terms import ModelData, ModelSpec

__all__ = ["EFPosterior", "EFTree", "merge_ef", "default_tol"]  # EFState stays importable from here, as before

def _called(name) -> None:
    warn_renamed(f"EFPosterior.{name} is a property, as on Gaussian posteriors: write post.{name} instead of "
                 f"post.{name}(); the call form will be removed in the next release")


class _Residual(float):
    """The residual as a float that can still be called (the pre-property spelling, deprecated)."""

    def __call__(self) -> _Residual:
        _called("residual")
        return self


class _Means(dict):
    """The posterior means as a dict that can still be called (the pre-property spelling, deprecated);
    a pytree like a dict."""

    def __call__(self) -> _Means:
        _called("mean")
        return self


jax.tree_util.register_pytree_with_keys(
    _Means, lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
    lambda keys, values: _Means(zip(keys, values)))


class EFTree(NamedTuple):
    """The numeric state of an :class:`EFPosterior` (a pytree; :meth:`EFPosterior.tree`).

    :ivar state: the :class:`~numpyro_pc.sites.expfam_table.EFState` (natural parameters and sites).
    :ivar stale_sites: a boolean scalar: the sites belong to an earlier ``λ`` (after ``remove_site``).
    :ivar tombstones: ids of deleted examples (never reused).
    :ivar next_id: the id the next new example gets.
    :ivar data_ids: the ids of the examples whose data is kept, or ``None``: every example's.
    """

    state: EFState
    stale_sites: jax.Array
    tombstones: jax.Array
    next_id: jax.Array
    data_ids: jax.Array | None = None


class EFPosterior(Posterior):
    """A mean-field exponential-family posterior with one cached site per example
    (a :class:`~numpyro_pc.protocols.posterior.Posterior`).

    :ivar config: :class:`~numpyro_pc.sites.expfam.EFConfig` (model binding, family, rule).
    :ivar data: the retained examples (:class:`~numpyro_pc.model.likelihood.ModelData`).
    :ivar state: :class:`EFState`.
    :ivar conjugate_prior: whether the prior term is conjugate-form (constant :math:`\\lambda_0`).
    :ivar guide_map: the hand-written guide's :class:`~numpyro_pc.guides.expfam.GuideMap`, if any.
    :ivar record: the last operation's diagnostics.
    :ivar tombstones: ids of deleted examples, sorted (never given to a new example).
    :ivar next_id: the id the next new example gets: past every id held or deleted.
    :ivar data_ids: the ids of the examples whose data is kept, aligned with the data rows (every
        site's example unless ``update(keep=...)`` dropped data; a site whose data is dropped stays,
        frozen).
    """

    __slots__ = ("config", "data", "state", "conjugate_prior", "guide_map", "record", "stale_sites", "tombstones",
                 "next_id", "_data_ids")
    # the slots' types (set once, by __init__ through object.__setattr__)
    config: EFConfig
    data: ModelData
    state: EFState
    conjugate_prior: bool
    guide_map: GuideMap | None
    record: Any  # a Record; an empty dict before any operation
    stale_sites: bool
    tombstones: tuple[int, ...]
    next_id: int
    _data_ids: jax.Array | None  # None: every site's example (the data_ids argument and property)

    def __init__(self, config, data, state, conjugate_prior, guide_map=None, record=None, stale_sites=False,
                 tombstones=(), next_id=0, data_ids=None):
        tombstones = tuple(sorted({int(i) for i in tombstones}))
        held = np.asarray(state.sites.ids)
        floor = max(int(held.max()) + 1 if held.size else 0, tombstones[-1] + 1 if tombstones else 0)
        for k, v in dict(config=config, data=data, state=state, conjugate_prior=conjugate_prior,
                         guide_map=guide_map, record=record or {}, stale_sites=bool(stale_sites),
                         tombstones=tombstones, next_id=max(int(next_id), floor),
                         _data_ids=checked_retained_ids(data_ids, held, data)).items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value) -> NoReturn:
        raise AttributeError("EFPosterior is immutable; operations return a new posterior")

    def evolve(self, **changes) -> Self:
        fields = {k.lstrip("_"): getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return type(self)(**fields)

    # ------------------------------------------------------------------ the distribution
    @property
    def family(self) -> ProductFamily:
        return self.config.family

    @property
    def natural(self) -> jax.Array:
        return self.state.natural

    @property
    def sites(self) -> EFSiteTable:
        """The cached sites (a :class:`~numpyro_pc.protocols.sites.SiteTable`)."""
        return self.state.sites

    @property
    def prior_natural(self) -> jax.Array:
        """:math:`\\lambda_0 = -g_0` (constant for a conjugate-form prior, else at the current ``q``)."""
        return self.sites.prior_natural()

    @property
    def ids(self) -> jax.Array:
        return self.sites.ids

    @property
    def num_examples(self) -> int:
        return self.sites.num_examples

    @property
    def spec(self) -> ModelSpec:
        """The model binding (:class:`~numpyro_pc.model.likelihood.ModelSpec`), as on Gaussian posteriors."""
        return self.config.spec

    @property
    def history(self) -> tuple:
        """``()``: the natural-gradient solve keeps no per-iterate record (``record.iterations``
        counts its iterations; a Gaussian posterior's ``history`` lists them)."""
        return ()

    @property
    def offset(self) -> None:
        r"""``None``: the natural parameters are exactly the prior term plus the sites
        (:math:`\lambda = \lambda_0 + \sum_i \hat\lambda_i`); no correction leaves a part no site holds."""
        return None

    @property
    def is_point_estimate(self) -> bool:
        """``False``: every factor is a distribution with learned natural parameters."""
        return False

    def tree(self) -> tuple[EFConfig, EFTree, ModelData]:
        """``(config, state, data)``: the static configuration (hashable), the numeric state (an
        :class:`EFTree` pytree: the natural parameters and sites, whether the sites are stale, the deleted
        ids and the next id) and the data, as a Gaussian posterior's
        :meth:`~numpyro_pc.dual.base.DualPosteriorBase.tree`; :meth:`from_tree` rebuilds the posterior
        (the provenance, ``record`` and ``guide_map``, is not part of it)."""
        state = EFTree(self.state, jnp.asarray(self.stale_sites), jnp.asarray(self.tombstones, jnp.int32),
                       jnp.asarray(self.next_id, jnp.int32), self._data_ids)
        return self.config, state, self.data

    @classmethod
    def from_tree(cls, config: EFConfig, state: EFTree, data: ModelData, *, conjugate_prior: bool,
                  guide_map: GuideMap | None = None, record=None) -> Self:
        """The posterior of :meth:`tree`'s parts; ``conjugate_prior``: whether the prior term is
        conjugate-form, so that its site stays constant (:attr:`conjugate_prior` of the posterior the tree
        came from)."""
        return cls(config, data, state.state, bool(conjugate_prior), guide_map, record, bool(state.stale_sites),
                   tuple(int(i) for i in np.asarray(state.tombstones)), int(state.next_id), state.data_ids)

    @property
    def data_ids(self) -> jax.Array:
        """Ids of the examples whose data is retained, aligned with the data rows (every example's
        unless an update dropped data with ``keep=``)."""
        return self.sites.ids if self._data_ids is None else self._data_ids

    @property
    def num_retained(self) -> int:
        """Examples whose data is retained."""
        return self.num_examples if self._data_ids is None else int(self._data_ids.shape[0])

    @property
    def residual(self) -> float:
        """Relative dual-form residual :math:`\\|\\lambda + g_0 + \\sum_i g_i\\| / (1 + \\|\\lambda\\|)`
        (a property, as on Gaussian posteriors; calling it is deprecated), with fresh sites after
        ``delete(method="remove_site")`` (:attr:`Posterior.residual <numpyro_pc.protocols.posterior.Posterior.residual>`),
        also when no example's data is kept: the prior term is then the one live site."""
        return _Residual(super().residual)

    def fresh_site_residual(self) -> float:
        """The residual with every retained example's site recomputed at the current ``λ`` (one site
        pass; a frozen site, whose data was dropped, counts as stored)."""
        const = fixed_part(self, self.sites.take(split_frozen(self)[1]))
        tau, _ = bucketed_target(self.config, self.data, not self.conjugate_prior, const)(self.natural)
        return _Residual(relative_residual(self.natural, tau))

    @property
    def site_identity_residual(self) -> float:
        """The identity's residual with the sites as stored."""
        return _Residual(relative_residual(self.natural, self.sites.prior_natural() + self.sites.natural_sum()))

    @property
    def mean(self) -> dict:
        """:math:`E_q[x]` per latent site (constrained values; the category probabilities of a
        categorical site); a property, as on Gaussian posteriors (calling it is deprecated)."""
        return _Means(self.family.mean(self.natural))

    def sample(self, key, num_samples) -> dict[str, jax.Array]:
        """``num_samples`` draws per latent site (constrained values, as the model's sites hold them);
        local latents (docs/hierarchical.md) one value per row, from their local factor given each draw."""
        draws = self.family.sample(self.natural, key, num_samples)
        values = self.family.to_constrained(draws)
        if self.spec.local is not None:
            if self.num_retained != self.num_examples:
                raise MissingCapabilityError(f"the local latents {list(self.spec.local.names)} are drawn per row, and "
                                             f"this posterior holds {self.num_retained} of its {self.num_examples} rows")
            with jax.enable_x64(self.natural.dtype == jnp.float64):
                z = jax.vmap(lambda point: model_point(self.spec, self.family, point)[0])(draws)
                values.update(local_draws(self.spec, self.data, z, jax.random.fold_in(key, 1)))
        return values

    @property
    def q(self) -> jax.Array:
        """The family member: the natural parameters ``λ``."""
        return self.natural

    def point_of(self, values: dict) -> dict:
        """Each factor's coordinate of the latent sites' constrained ``values``."""
        return {f.site: f.from_constrained(jnp.asarray(values[f.site])) for f in self.family.factors}

    def model_point(self, point) -> tuple:
        """``(z, discrete, log_det)`` at factor coordinates ``point`` (:func:`numpyro_pc.sites.expfam.model_point`)."""
        return model_point(self.spec, self.family, point)

    def probe_points(self, num: int) -> list:
        """``num`` draws of the posterior (key 7) in the model's coordinates."""
        draws = self.family.sample(self.natural, jax.random.PRNGKey(7), num)
        return [self.model_point({name: v[k] for name, v in draws.items()})[:2] for k in range(num)]

    def latent_factors(self) -> dict:
        """:meth:`distributions`: the product's factors."""
        return self.distributions()

    def recompute_sites(self, q) -> EFSiteTable:
        """Every retained example's site (rows in :attr:`data_ids` order) and the prior term recomputed at
        natural parameters ``q``."""
        fresh = compute_sites(self.config, q, self.data)  # the config is sized to the data
        return EFSiteTable(fresh.grads, fresh.prior, self.data_ids)

    @property
    def residual_parts(self) -> dict[str, float]:
        """``{"natural": residual}``: the one identity of the fixed point, in natural parameters
        (a Gaussian posterior's splits into its mean and precision parts)."""
        return {"natural": float(self.residual)}

    @property
    def precision(self) -> NoReturn:
        """Refused: a precision matrix belongs to a Gaussian over all latent coordinates."""
        raise self._not_one_gaussian("post.precision")

    @property
    def covariance(self) -> NoReturn:
        """Refused: a covariance matrix belongs to a Gaussian over all latent coordinates."""
        raise self._not_one_gaussian("post.covariance")

    def _not_one_gaussian(self, operation: str) -> MissingMemberError:
        factors = ", ".join(f"{f.site}: {type(f).family_name or type(f).__name__}" for f in self.family.factors)
        return MissingMemberError(
            f"{operation} needs q to be one Gaussian over every latent coordinate; this posterior is a product of "
            f"factors ({factors}) whose natural parameters are post.natural — post.distributions() gives each "
            "factor as a distribution, and post.sample_unconstrained(key, n) draws from it for moments")

    def site_curvature(self) -> NoReturn:
        """Refused: the sites are natural-parameter sites, with no stored curvature
        (:class:`~numpyro_pc.protocols.capabilities.SiteCurvature`)."""
        require(self.family, SiteCurvature, "post.site_curvature()")
        raise AssertionError("unreachable: a product family has no stored site curvature")

    def log_prob(self, point) -> jax.Array:
        r""":math:`\log q` at ``point``, each factor's coordinates (:meth:`point_of` of constrained values;
        a leading batch axis allowed), as a Gaussian posterior's ``log_prob(post.point_of(values))``."""
        with jax.enable_x64(self.natural.dtype == jnp.float64):
            return self.family.log_prob(self.natural, point)

    def sample_unconstrained(self, key: jax.Array, num_samples: int) -> jax.Array:
        """Draws of the flat unconstrained vector of the continuous latent sites, shape ``(num_samples, d)``
        (each factor's draws mapped to the model's unconstrained coordinates)."""
        check_key(key)
        num_samples = check_count(num_samples, "num_samples", allow_none=False)
        with jax.enable_x64(self.natural.dtype == jnp.float64):
            draws = self.family.sample(self.natural, key, num_samples)
            return jax.vmap(lambda point: model_point(self.spec, self.family, point)[0])(draws)

    def log_likelihood(self, z) -> dict[str, jax.Array]:
        """Per-site, per-example log-likelihood at flat unconstrained values ``z`` of the continuous
        latent sites (``{site: (..., N)}``), as on Gaussian posteriors.

        :raises MissingCapabilityError: the model has discrete latent sites, which ``z`` does not hold.
        """
        if self.spec.latent.discrete_names:
            raise MissingCapabilityError(
                f"post.log_likelihood(z) evaluates the model at the continuous latents z alone; this model also has "
                f"discrete latent sites {list(self.spec.latent.discrete_names)}, whose values z does not hold — "
                "sum over them with post.to_arviz(key), whose log_likelihood group draws them")
        with jax.enable_x64(self.natural.dtype == jnp.float64):
            return site_log_likelihoods(self.spec, self.data, z)

    def distributions(self) -> dict[str, Distribution]:
        """Each latent site's factor as a NumPyro distribution of the site's constrained value
        (a Gaussian factor on a constrained site is a ``TransformedDistribution``)."""
        return {f.site: f.distribution(p) for f, p in zip(self.family.factors, self.family.split(self.natural))}

    def entropy(self) -> jax.Array:
        return self.family.entropy(self.natural)

    def kl(self, other) -> jax.Array:
        """:math:`KL(q \\| q_{other})` to a posterior of the same model and family.

        :raises IncompatiblePosteriorsError: ``other`` is not one.
        """
        self.check_comparable(other, "KL")
        return self.family.kl(self.natural, other.natural)

    def to_arviz(self, key, num_samples=1000) -> InferenceData:
        """ArviZ ``InferenceData`` with ``posterior`` (constrained draws of each latent site),
        ``log_likelihood`` (one ``(chain, draw, N)`` variable per observed site of the data plate
        and their sum ``"joint"`` when an example has several) and ``observed_data`` groups, one
        chain of ``num_samples`` draws; see :func:`numpyro_pc.sites.expfam_eval.inference_data`.

        :param key: a ``jax.random.PRNGKey``.
        """
        with jax.enable_x64(self.natural.dtype == jnp.float64):
            return inference_data(self, key, num_samples)

    def to_guide_params(self, guide=None, args=(), kwargs=None) -> dict[str, jax.Array]:
        """The hand-written guide's params describing this posterior.

        :param guide: a guide to write for (default: the guide read by :func:`~numpyro_pc.dual.expfam_fit.dual_form_ef`);
            it is traced with its own initial params to find which param feeds which argument.
        """
        gmap = self.guide_map
        if guide is not None:
            gmap, _ = read_guide(guide, None, self.family.names, args, kwargs)
        if gmap is None:
            raise InvalidOptionError("this posterior was not read from a guide; pass guide= to to_guide_params")
        return write_params(gmap, self.family, self.natural)

    # ------------------------------------------------------------------ operations
    @solver_group
    def update(self, *args, correction: str = "exact", memory=None, selection: str = "random", keep="all",
               seed: int = 0, tol: float | None = None, max_iters: int | None = None, progress: bool = False,
               raise_on_failure: bool = True, batch_fraction: float = 0.1, epochs: int | None = None,
               **kwargs) -> EFPosterior:
        """Add a batch (paper §3.1, eq. ``postcorr``), with the options of the Gaussian
        :meth:`~numpyro_pc.DualPosterior.update` read by the same rules (:mod:`numpyro_pc.dual.expfam_adapt`).

        New examples get the next free ids. ``correction`` chooses which stale sites are
        recomputed at the new fixed point — ``"exact"``: all of them (the batch posterior);
        ``"none"``: none (VCL: the old sites and prior term stay frozen, only the new sites are
        solved for); ``"prior"``: the prior term (differs from ``"none"`` only for a prior that is
        not conjugate-form); ``"memory"``: the prior term and the sites of a memory set;
        ``"stochastic"``: after the ``"prior"`` update, ``epochs`` passes (default 1) over the
        retained examples in random blocks of ``batch_fraction`` of them, each block's sites recomputed
        at the fixed point with the others held (block Gauss–Seidel on the dual form: it tends to
        the exact update as the passes grow). ``"weighted"`` and ``"kprior"`` are refused: they leave
        a part outside the sites, and these posteriors hold no natural parameters outside their sites.

        :param memory: for ``"memory"``: a count of examples, a fraction in ``(0, 1]`` of them, or
            their ids (:func:`numpyro_pc.sites.memory_sets.corrected_ids`).
        :param str selection: how a memory of a given size is chosen: ``"random"`` (with ``seed``)
            or ``"leverage"`` (the largest second-order KL of removing the site); ``"residual"`` and
            ``"curvature"`` rank Gaussian sites and are refused here.
        :param keep: data retention, as on Gaussian posteriors: ``"all"``, ``"none"`` or a reservoir
            size (an int: a uniform sample of the stream, with ``seed``); the sites of examples whose
            data is dropped stay, frozen — later corrections, deletions and refinements recompute only
            the retained examples' sites.
        :param bool progress: show a progress bar of the solve.
        :return: a new :class:`EFPosterior`; ``record`` holds the operation's diagnostics.
        :raises InvalidOptionError: an unknown or inconsistent option.
        :raises MissingCapabilityError: an option these families have no meaning for.
        """
        return update_ef(self, *args, correction=correction, memory=memory, selection=selection, keep=keep,
                         seed=seed, tol=tol, max_iters=max_iters, progress=progress,
                         raise_on_failure=raise_on_failure, batch_fraction=batch_fraction, epochs=epochs, **kwargs)

    @solver_group
    def refine(self, tol: float | None = None, max_iters: int | None = None, step_size: float = 1.0,
               raise_on_failure: bool = True, progress: bool = False) -> EFPosterior:
        """Natural-gradient steps from the current natural parameters until every site is fresh and the
        dual-form residual is below ``tol`` (after a merge, a site removal or a VCL update).

        :param float step_size: the largest damping ``ρ ∈ (0, 1]`` of a step.
        :param bool raise_on_failure: raise :class:`~numpyro_pc.errors.ConvergenceError` (carrying the
            last posterior as ``err.posterior``) when ``tol`` is not reached; ``False`` warns instead.
        :param bool progress: show a progress bar.
        :return: a new :class:`EFPosterior` with fresh sites; ``record`` holds the solve's diagnostics.
        """
        return refine_ef(self, tol=tol, max_iters=max_iters, step_size=step_size, raise_on_failure=raise_on_failure,
                         progress=progress)

    @solver_group
    def delete(self, ids, method: str = "remove_site", damping: bool = False, tol: float | None = None,
               max_iters: int | None = None, raise_on_failure: bool = True) -> EFPosterior:
        """Remove examples (paper §3.2). ``"remove_site"``: :math:`\\lambda + \\sum_{j\\in J} g_j`;
        ``"corrected"``: then the retained sites are recomputed to the fixed point (exact);
        ``"retrain"``: the fixed point of the retained data solved again from the prior (the
        reference the others are measured against).

        ``"influence"`` and ``"tracin"`` are refused: they approximate a removal by a Newton or a
        gradient step in a Gaussian's mean, while here removing the sites is exact in the natural
        parameters and ``"corrected"`` recomputes the others.

        :param bool damping: when removing the sites would leave the natural domain, remove the
            largest fraction :math:`\\alpha` of them that stays inside (× 0.99) instead of raising,
            reported in ``record["damping"]`` (as on Gaussian posteriors).
        :raises OutOfDomainError: ``"remove_site"`` leaving a shape parameter non-positive (without
            ``damping``).
        :raises UnknownExampleError: ids that are not held.
        """
        return delete_ef(self, ids, method=method, damping=damping, tol=tol, max_iters=max_iters,
                         raise_on_failure=raise_on_failure)

    def merge(self, *others, alphas=None, method="bayesian", refine=False, tol=None, max_iters=200) -> EFPosterior:
        r"""Bayesian arithmetic with posteriors of the same model, family and prior fitted on other
        examples: :math:`\lambda = \lambda_0 + \sum_k \alpha_k (\lambda_k - \lambda_0)`, sites
        concatenated (exact for conjugate models; :func:`numpyro_pc.ops.merging.merge`). Ids that collide
        with earlier posteriors' are shifted past them (``record["renumbered"]``). ``refine=True`` then
        recomputes every site at the fixed point.

        :raises IncompatiblePosteriorsError: other models, families, priors or site designs.
        """
        merged = super().merge(*others, alphas=alphas, method=method)
        if refine:
            solved = solve_every_site(merged, merged.data, merged.ids, merged.natural, tol, max_iters, True)
            merged = solved.evolve(record=merged.record.replace(**solved.record.solve_fields()))
        return merged

    def __repr__(self) -> str:
        return (f"EFPosterior({', '.join(f'{n}: {fam}' for n, (fam, _) in self.family.describe(self.natural).items())}"
                f", N={self.num_examples})")


def merge_ef(a, b, refine=False, tol=None, max_iters=200) -> EFPosterior:
    """Deprecated: ``a.merge(b, refine=refine)`` (:meth:`EFPosterior.merge`, which also takes several
    posteriors and weights); this alias stays for one release."""
    warn_renamed("numpyro_pc.dual.expfam.merge_ef is deprecated: write a.merge(b) or pc.merge(None, [a, b]); "
                 "the alias will be removed in the next release")
    return a.merge(b, refine=refine, tol=tol, max_iters=max_iters)
