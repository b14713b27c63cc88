r"""The one posterior type: what every dual-form posterior is and answers, whatever its family.

A fitted posterior in dual form (paper eq. ``qdualform``) is a distribution
:math:`q \propto p_0 \prod_i \exp(-\hat\ell_i)` of a minimal exponential family together
with its cached sites, its retained data and its model binding. The Gaussian families
(:class:`~numpyro_pc.dual.base.DualPosteriorBase`: full, diagonal, isotropic, low-rank) and the
exponential-family products (:class:`~numpyro_pc.dual.expfam.EFPosterior`: Beta, Gamma,
Dirichlet, Gaussian blocks, discrete factors) are both :class:`Posterior`\ s: code that takes
"a posterior" annotates and checks this one type, and every member below exists on both
with one meaning.

The operations that live above the posterior in the package's layers (saving, merging,
adding and deleting data) are *looked up by name* when called: the module that implements
one registers it with :func:`provides`, so a posterior can offer ``post.save(path)`` and
``post.merge(other)`` without its module importing the file format or the merge rules.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, Self
from pathlib import Path

import jax

from numpyro_pc.errors import (
    IncompatiblePosteriorsError,
    MissingCapabilityError,
    PosteriorCorrectionError,
    UnsupportedGuideError,
)

__all__ = ["Posterior", "provides", "by_site_table", "require_posterior"]

_OPERATIONS: dict[str, Callable] = {}


def provides(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the implementation of :class:`Posterior` operation ``name``
    (``"save"``, ``"merge"``, ``"update"``, ``"delete"``); it receives the posterior first."""

    def register(fn: Callable) -> Callable:
        _OPERATIONS[name] = fn
        return fn

    return register


def _operation(name: str) -> Callable:
    try:
        return _OPERATIONS[name]
    except KeyError:  # only when a module was imported without the package (numpyro_pc/__init__ imports all)
        raise PosteriorCorrectionError(f"posterior operation {name!r} is not available: import numpyro_pc "
                                       "rather than one of its modules alone") from None


if TYPE_CHECKING:
    class SiteTableOperation(Protocol):
        """What :func:`by_site_table` returns: the operation, with its table's ``register`` and ``dispatch``."""

        def __call__(self, post: Any, /, *args: Any, **kwargs: Any) -> Any: ...

        def register(self, cls: Any, func: Any = None) -> Any: ...

        def dispatch(self, cls: Any) -> Callable[..., Any]: ...


def require_posterior(obj: object, operation: str, error: type[Exception] = UnsupportedGuideError) -> None:
    """Refuse ``obj`` with ``error`` unless it is a :class:`Posterior`, naming ``operation`` and what was found."""
    if not isinstance(obj, Posterior):
        raise error(f"{operation} needs a dual-form posterior (from pc.fit or pc.dual_form); found {type(obj).__name__}")


def by_site_table(operation: str, error: type[Exception] = UnsupportedGuideError) -> SiteTableOperation:
    """An operation whose implementation depends on the family's sites: ``impl(post, *args)`` runs
    the implementation registered for the type of ``post.sites`` (``@impl.register(TableType)``),
    the one place an operation looks up what to do with a family's site table — a new family
    registers its table's implementations, whatever the posterior's class.

    :param str operation: the operation's name, for the refusals.
    :param error: what an object that is not a :class:`Posterior` raises.
    :raises MissingCapabilityError: (when called) a posterior whose site table has no
        implementation of ``operation``.
    """

    def refuse(sites, post, *args, **kwargs) -> NoReturn:
        raise MissingCapabilityError(f"{operation} has no implementation for the sites of the "
                                     f"{getattr(post.family, 'name', type(post.family).__name__)} family "
                                     f"({type(sites).__name__}); register one with {operation}.register")

    table = functools.singledispatch(refuse)

    def call(post, *args, **kwargs) -> Any:
        require_posterior(post, operation, error)
        impl = table.dispatch(post.site_table_type)
        if impl is refuse:
            refuse(post.sites, post)
        return impl(post, *args, **kwargs)

    call.register = table.register  # type: ignore[attr-defined]
    call.dispatch = table.dispatch  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


class Posterior(ABC):
    """A fitted posterior in dual form: one cached site per example (and a prior site) whose
    natural parameters add up to the posterior's, :math:`\\lambda = \\lambda_0 + \\sum_i \\hat\\lambda_i`.

    Immutable: every operation returns a new posterior. The members below have one meaning
    for every family; a family adds its own (a Gaussian's ``precision`` and ``covariance``, a
    product's ``distributions()``). Where an operation has no meaning for a family it raises
    a typed error that says why in mathematical terms (the table in docs/operations.md).
    """

    __slots__ = ()
    #: What the operation that returned this posterior did (a :class:`~numpyro_pc.protocols.records.Record`:
    #: ``FitInfo``, ``UpdateInfo``, …).
    record: Any

    # ------------------------------------------------------------------ what it is
    @property
    @abstractmethod
    def spec(self) -> object:  # a ModelSpec: the model binding sits above this layer
        """The model binding (:class:`~numpyro_pc.model.likelihood.ModelSpec`)."""

    @property
    @abstractmethod
    def family(self) -> object:
        """The variational family (a Gaussian family or a product of exponential families)."""

    @property
    @abstractmethod
    def ids(self) -> jax.Array:
        """Stable integer ids of the examples with a site, aligned with the sites."""

    @property
    @abstractmethod
    def num_examples(self) -> int:
        """Number of examples with a site."""

    @property
    @abstractmethod
    def num_retained(self) -> int:
        """Number of examples whose data is kept (and whose sites can be recomputed)."""

    @property
    @abstractmethod
    def mean(self) -> Any:
        """The posterior mean (a Gaussian's flat unconstrained ``m``; per latent site for a product)."""

    @property
    @abstractmethod
    def natural(self) -> Any:
        """The natural parameters :math:`\\lambda` of the posterior."""

    @property
    @abstractmethod
    def q(self) -> object:
        """The posterior as a member of its family, in the form the family's functions take (a
        Gaussian family's ``(mean, precision)`` state, a product's natural-parameter vector)."""

    # ------------------------------------------------------------------ coordinates
    @abstractmethod
    def point_of(self, values: dict) -> jax.Array:
        """The family's coordinates of the model's latent values ``values`` (``{site: value}``,
        constrained, as the model's sample sites hold them): a flat unconstrained ``z`` for a
        Gaussian family, ``{site: factor coordinate}`` for a product."""

    @abstractmethod
    def model_point(self, point) -> tuple:
        """``(z, discrete, log_det)``: the model binding's flat unconstrained latents and discrete
        values at ``point`` (the family's coordinates), and the log-determinant that makes
        ``prior_loss(spec, z, data, discrete) + log_det`` the negative log prior as a density of
        those coordinates (``0`` where they are ``z`` itself)."""

    @abstractmethod
    def probe_points(self, num: int) -> list:
        """``num`` points ``(z, discrete)`` in the model's coordinates around the posterior, seeded
        (where :func:`numpyro_pc.ops.handlers.check_same_model` compares two models' terms)."""

    @abstractmethod
    def latent_factors(self) -> dict | None:
        """Each latent site's factor as a NumPyro distribution of its constrained value, or ``None``
        where the posterior is one joint density over the flat latents (a Gaussian family)."""

    @property
    @abstractmethod
    def stale_sites(self) -> bool:
        """Whether the retained examples' sites belong to an earlier ``q``: set by the approximate
        deletions (``remove_site``, ``influence``, ``tracin``), kept by every operation that does
        not recompute the retained sites, cleared by ``refine()``, an exact update and a corrected
        or retrained deletion."""

    @property
    def site_table_type(self) -> type:
        """The class of :attr:`sites` (what :func:`by_site_table` dispatches on), without gathering rows
        that a posterior holds lazily."""
        return type(self.sites)

    @property
    def residual(self) -> float:
        """Relative residual of the dual-form identity :math:`\\lambda = \\lambda_0 + \\sum_i \\hat\\lambda_i`
        at the sites' fixed point (0 at the variational optimum).

        With stale sites (:attr:`stale_sites`) the stored identity still holds by construction
        and says nothing about the deletion's error; the residual is then taken with every
        retained example's site recomputed at the current ``q`` (one site pass,
        :meth:`fresh_site_residual`; with no data kept, the prior's site alone): how far the
        posterior is from the fixed point of the remaining data. :attr:`site_identity_residual` is the stored identity, whatever the
        sites' age.
        """
        if self.stale_sites:  # with no data kept, the prior's site is the one recomputed
            return self.fresh_site_residual()
        return self.site_identity_residual

    @property
    @abstractmethod
    def site_identity_residual(self) -> float:
        """The residual of the identity with the sites as stored (what a saved file records)."""

    @abstractmethod
    def recompute_sites(self, q) -> Any:
        """The retained examples' sites, and the prior site, recomputed at ``q`` (a member of this
        posterior's family, e.g. another posterior's :attr:`q`): a
        :class:`~numpyro_pc.protocols.sites.SiteTable` with rows in :attr:`data_ids` order."""

    @abstractmethod
    def fresh_site_residual(self) -> float:
        """The residual with every retained example's site recomputed at the current ``q``."""

    # ------------------------------------------------------------------ what it answers
    @abstractmethod
    def sample(self, key, num_samples: int) -> dict[str, jax.Array]:
        """``num_samples`` draws of the latent sites (constrained values, as the model holds them)."""

    @abstractmethod
    def entropy(self) -> jax.Array:
        """The entropy of the posterior."""

    @abstractmethod
    def kl(self, other: Posterior) -> jax.Array:
        """:math:`KL(q \\| q_{other})` to a posterior of the same family."""

    # ------------------------------------------------------------------ members every family answers
    # (or, where one has no meaning for the family, refuses with MissingMemberError / MissingCapabilityError)
    @property
    def latent(self) -> Any:
        """The :class:`~numpyro_pc.model.latent.LatentSpace` (site names, shapes, order)."""
        return self.spec.latent  # type: ignore[attr-defined]  # a ModelSpec (the model layer sits above)

    @property
    def dim(self) -> int:
        """Dimension ``d`` of the flat unconstrained vector of the continuous latent sites."""
        return int(self.latent.dim)

    @property
    @abstractmethod
    def history(self) -> tuple:
        """The last solve's iterates (:class:`~numpyro_pc.protocols.records.IterationInfo`), where the
        family's solver records them (``()`` where it does not)."""

    @property
    @abstractmethod
    def offset(self) -> Any:
        """Natural parameters no single site holds (``λ = λ₀ + offset + Σᵢ λ̂ᵢ``), or ``None``."""

    @property
    @abstractmethod
    def is_point_estimate(self) -> bool:
        """Whether the posterior is a point (MAP / ERM), whose samples are the point itself."""

    @property
    @abstractmethod
    def residual_parts(self) -> dict[str, float]:
        """The residual of each identity the fixed point satisfies (names depend on the family)."""

    @property
    @abstractmethod
    def precision(self) -> Any:
        """The precision matrix of a posterior that is one Gaussian over every latent coordinate."""

    @property
    @abstractmethod
    def covariance(self) -> Any:
        """The covariance matrix of a posterior that is one Gaussian over every latent coordinate."""

    @abstractmethod
    def tree(self) -> tuple:
        """``(config, state, data)``: static configuration, numeric state (a pytree) and data."""

    @abstractmethod
    def distributions(self) -> dict:
        """Each latent site's marginal as a NumPyro distribution of its constrained value."""

    @abstractmethod
    def log_prob(self, point) -> jax.Array:
        r""":math:`\log q` at ``point`` (the family's coordinates: :meth:`point_of` of constrained values)."""

    @abstractmethod
    def sample_unconstrained(self, key, num_samples: int) -> jax.Array:
        """Draws of the flat unconstrained vector of the continuous latent sites ``(num_samples, d)``."""

    @abstractmethod
    def log_likelihood(self, z) -> dict[str, jax.Array]:
        """Per-site, per-example log-likelihood at flat unconstrained values ``z`` (``{site: (..., N)}``)."""

    @abstractmethod
    def site_curvature(self) -> Any:
        """Per-example ``tr Ĥᵢ``, for families whose sites store a curvature."""

    def check_comparable(self, other: object, operation: str) -> None:
        """Refuse ``other`` unless it is a posterior of the same model's latent sites in the same family
        (what a KL or a comparison between two posteriors needs).

        :raises IncompatiblePosteriorsError: saying which of the three differs.
        """
        if not isinstance(other, Posterior):
            raise IncompatiblePosteriorsError(f"{operation} needs another dual-form posterior of the same model; got "
                                              f"{type(other).__name__}")
        if other.spec.latent.signature() != self.spec.latent.signature():
            raise IncompatiblePosteriorsError(f"{operation}: the posteriors belong to models with different latent "
                                              f"sites ({self.spec.latent.signature()} vs "
                                              f"{other.spec.latent.signature()})")
        if other.family != self.family:
            raise IncompatiblePosteriorsError(f"{operation} between different families ({self.family.name} vs "
                                              f"{getattr(other.family, 'name', type(other.family).__name__)})")

    @abstractmethod
    def to_arviz(self, key, num_samples: int = 1000) -> Any:
        """ArviZ ``InferenceData`` with posterior draws, pointwise log-likelihoods and the observed data."""

    @abstractmethod
    def to_guide_params(self, guide=None) -> dict[str, jax.Array]:
        """The guide's params that describe this posterior."""

    @abstractmethod
    def evolve(self, **changes) -> Self:
        """A copy with the given fields changed, of this posterior's class (nothing recomputed)."""

    # ------------------------------------------------------------------ what changes it
    @abstractmethod
    def refine(self, tol: float | None = None, max_iters: int | None = None, step_size: float = 1.0,
               raise_on_failure: bool = True, progress: bool = False) -> Posterior:
        """Every site recomputed at the fixed point from the current ``q`` (paper eq. ``qdualform``):
        after a merge, a site removal or an update that left sites stale; the result's residual is
        below ``tol``.

        :raises ConvergenceError: ``tol`` not reached (with ``raise_on_failure``); ``err.posterior``
            is the last iterate.
        """

    def update(self, *args, **kwargs) -> Posterior:
        """Add a batch of examples with a correction of the stale sites (paper §3.1); see
        :func:`numpyro_pc.ops.streaming.update` and :meth:`numpyro_pc.dual.expfam.EFPosterior.update`."""
        return _operation("update")(self, *args, **kwargs)

    def change_prior(self, model=None, **kwargs) -> Posterior:
        """The posterior of the same data under another prior: ``model`` with the fitted likelihood, or new values
        of the fitted model's fixed arguments as keywords (:func:`numpyro_pc.ops.prior_change.change_prior`)."""
        return _operation("change_prior")(self, model, **kwargs)

    def keep_memory(self, size, selection: str = "random", seed: int = 0) -> Posterior:
        """Keep the data of ``size`` retained examples only, chosen by ``selection`` (``"random"``, ``"residual"``,
        ``"curvature"``, ``"leverage"``): the function-space memory that ``update(..., correction="kprior")``
        matches (Gaussian families; an exponential-family product refuses the K-prior and keeps this as a data
        bound); the others' sites stay, frozen (:func:`numpyro_pc.ops.kprior.keep_memory`)."""
        return _operation("keep_memory")(self, size, selection=selection, seed=seed)

    @property
    def memory(self) -> Any:
        """The function-space memory: the retained examples, their predictions at the mean and their sites
        (:class:`numpyro_pc.ops.kprior.FunctionMemory`)."""
        return _operation("memory")(self)

    def delete(self, ids, **kwargs) -> Posterior:
        """Remove the examples ``ids`` (paper §3.2); see :func:`numpyro_pc.ops.unlearning.delete`."""
        return _operation("delete")(self, ids, **kwargs)

    def merge(self, *others: Posterior, alphas=None, method: str = "bayesian") -> Posterior:
        """Merge with posteriors of the same model and family fitted on other examples:
        ``pc.merge(None, [self, *others], alphas, method)`` (:func:`numpyro_pc.ops.merging.merge`)."""
        return _operation("merge")(None, [self, *others], alphas=alphas, method=method)

    def save(self, path: str | os.PathLike, key: bytes | str | None = None) -> Path:
        """Write the posterior atomically to ``path`` (:func:`numpyro_pc.io.save_load.save`); ``key`` signs it (HMAC)."""
        return _operation("save")(self, path, key=key)
