"""Typed exceptions raised by :mod:`numpyro_pc`.

Every error the package raises on bad input or failed numerics derives from
:class:`PosteriorCorrectionError`, so callers can catch the whole family at once, and
each also derives from the matching built-in exception (``ValueError``, ``TypeError``,
...) so generic handlers keep working.
"""


class PosteriorCorrectionError(Exception):
    """Base class of every error raised by :mod:`numpyro_pc`."""


class UnsupportedGuideError(PosteriorCorrectionError, TypeError):
    """The guide class has no exponential-family adapter."""


class GuideParamsError(PosteriorCorrectionError, ValueError):
    """The parameters do not belong to the guide (missing keys, wrong shapes)."""


class UnsupportedModelError(PosteriorCorrectionError, ValueError):
    """The model's structure is outside what the dual form supports.

    Examples: latent sites inside the data plate (local latents), observed sites outside
    any plate whose rows cannot be inferred (no batch dimension, leading dimensions that
    disagree or match no argument's length), discrete latent sites, or an ambiguous data
    plate.
    """


class MissingCapabilityError(UnsupportedGuideError, UnsupportedModelError):
    """The operation needs something of the variational family that the family does not have
    (:mod:`numpyro_pc.protocols.capabilities`): e.g. dividing sites out of a low-rank posterior, whose
    precision is a projection of the site sum. The message names the operation, what it needs
    and, in mathematical terms, why the family lacks it. Caught as either of its bases."""


class MissingMemberError(MissingCapabilityError, AttributeError):
    """A member of :class:`~numpyro_pc.protocols.posterior.Posterior` that has no meaning for this posterior's
    family (a product's ``covariance``): also an ``AttributeError``, so ``hasattr`` is ``False``."""


class DataShapeError(PosteriorCorrectionError, ValueError):
    """A data argument's leading size disagrees with the data plate."""


class DataSupportError(PosteriorCorrectionError, ValueError):
    """Observed values outside the support of their distribution (a Bernoulli label 2, a
    negative or fractional Poisson count)."""


class DataTypeError(PosteriorCorrectionError, TypeError):
    """A data argument whose type cannot be converted to a numeric array without loss
    (text, mixed-type columns)."""


class NonFiniteDataError(PosteriorCorrectionError, ValueError):
    """A data argument contains NaN or infinite values."""


class NonFiniteResultError(PosteriorCorrectionError, FloatingPointError):
    """A computation produced NaN or infinite values."""


class NotPositiveDefiniteError(PosteriorCorrectionError, ValueError):
    """A precision (or covariance) matrix is not positive definite."""


class OutOfDomainError(NotPositiveDefiniteError):
    """A natural parameter left its family's domain (a Beta, Gamma or Dirichlet shape parameter ≤ 0)."""


class ConvergenceError(PosteriorCorrectionError, RuntimeError):
    """An iterative solver stopped before reaching its tolerance.

    :ivar posterior: the last iterate (a usable object, not at the requested tolerance).
    :ivar history: the per-iteration record of the solver.
    """

    def __init__(self, message, posterior=None, history=None):
        super().__init__(message)
        self.posterior = posterior
        self.history = history


class StagnationError(ConvergenceError):
    """The solver stopped early because its residual stopped falling.

    Raised long before ``max_iters`` when the residual has not improved by a useful factor
    over a window of iterations, or when only tiny damped steps are accepted; the message
    names the likely cause and what to try.
    """


class ModelBindingError(UnsupportedModelError):
    """The per-example evaluation of the model does not reproduce the model's log density.

    Binding checks at probe points that ``ℓ_0(z) + Σ_i ℓ_i(z)`` equals the model's full
    negative log joint; this error says which plate or argument is not tied to the data.
    """


class ExpectationRuleError(PosteriorCorrectionError, ValueError):
    """The requested expectation rule does not apply to this model."""


class SiteStorageError(PosteriorCorrectionError, ValueError):
    """The requested per-example site storage is impossible or too large.

    :ivar remedies: the fixes the message suggests, each a dict of options that, added to the
        call that raised (``pc.fit``, ``pc.dual_form``, ``compute_sites``'s ``curvature`` and
        ``storage``; ``expectation="delta"`` is the rule ``"delta"``), avoids this error.
    """

    def __init__(self, message, remedies=()):
        super().__init__(message)
        self.remedies = tuple(dict(r) for r in remedies)


class UnknownExampleError(PosteriorCorrectionError, KeyError):
    """An example id is not in the posterior (never added, already deleted, or its data was dropped)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class InvalidOptionError(PosteriorCorrectionError, ValueError):
    """An option has a value outside its documented choices (e.g. a misspelt ``method``)."""


class NotFittedError(PosteriorCorrectionError, RuntimeError):
    """A model was asked for a prediction or plot before it absorbed any data."""


class InvalidIdsError(PosteriorCorrectionError, TypeError):
    """Example ids that are not integers (ids are never rounded or truncated)."""


class PrecisionLossError(PosteriorCorrectionError, FloatingPointError):
    """The computation lost the accuracy its result needs in the current floating dtype.

    Raised, for example, for a float32 posterior whose precision matrix is too badly
    conditioned for float32 to represent its covariance; enable float64.
    """


class IncompatiblePosteriorsError(PosteriorCorrectionError, ValueError):
    """Posteriors that cannot be combined (different models, latent sites, families or dtypes)."""


class MonteCarloErrorWarning(UserWarning):
    """A Monte Carlo fixed point whose residual under independent draws is well above the
    tolerance: the answer is only as accurate as the Monte Carlo error."""


class BoundaryOptimumWarning(UserWarning):
    """A converged dual form at a collapsed scale (a constrained latent far beyond its prior's
    range) that the default start of :func:`numpyro_pc.fit` beats on the variational objective:
    a local optimum, not the family's best (:mod:`numpyro_pc.solvers.boundary`)."""


class PointEstimateWarning(UserWarning):
    """Samples of a point-estimate posterior (``AutoDelta``, the isotropic family with the
    delta rule) are the point itself: it carries no posterior uncertainty."""


class ModelMismatchError(PosteriorCorrectionError, ValueError):
    """A model differs from the one a posterior was built with (see :mod:`numpyro_pc.io.fingerprint`).

    :ivar differences: human-readable list of what differs.
    """

    def __init__(self, message, differences=()):
        super().__init__(message)
        self.differences = tuple(differences)


class PersistenceError(PosteriorCorrectionError, OSError):
    """A saved posterior cannot be written, or read back as it was written."""


class MissingFileError(PersistenceError, FileNotFoundError):
    """No saved posterior exists at the given path."""


class CorruptFileError(PersistenceError):
    """The file is truncated, not an archive, malformed, or an array fails its checksum."""


class OversizedFileError(CorruptFileError):
    """A member is compressed, larger than declared, or the archive declares more than it holds."""


class InconsistentFileError(CorruptFileError):
    """The arrays and manifest are each well formed but disagree with each other (shapes, ids,
    non-finite values, a precision that is not positive definite, a residual that differs)."""


class IntegrityError(CorruptFileError):
    """The keyed signature (HMAC) is missing or does not match: the file was altered or the key is wrong."""


class FormatVersionError(PersistenceError):
    """The file was written by an incompatible format version."""


class DtypeMismatchError(PersistenceError):
    """The arrays' dtype disagrees with the manifest or cannot be represented now (x64 off)."""


class SavedModelMismatchError(PersistenceError, ModelMismatchError):
    """The model given to :func:`numpyro_pc.io.save_load.load` is not the one the posterior was saved with."""


class ClientMessageError(PosteriorCorrectionError, ValueError):
    """A federated client's message failed the server's checks (shape, dtype, finiteness, PSD, size).

    :ivar client: the sender's id as the transport (not the message) gives it.
    """

    def __init__(self, message, client=None):
        super().__init__(message)
        self.client = client


class TooFewClientsError(PosteriorCorrectionError, RuntimeError):
    """Fewer federated clients than the stated minimum answered a round with a valid message.

    :ivar result: the partial result (last good posterior, history, reason), when there is one.
    """

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result


class PrivacyError(PosteriorCorrectionError, RuntimeError):
    """A federated client refuses to send a message its privacy settings forbid.

    Raised when the client holds fewer examples than the run's ``min_examples`` (its site
    would reveal them) or when its differential-privacy budget (the number of releases its
    noise was calibrated for) is spent.
    """


class SuspectClientsError(PosteriorCorrectionError, RuntimeError):
    """A federated run ended its rounds, but the server refused or bounded messages of some clients.

    Raised by the cross-process servers at the end of a run
    (:meth:`~numpyro_pc.federated.server.ServerLogic.check_clients`,
    :func:`~numpyro_pc.federated.flower.start_server`): a message refused by the checks (shape, dtype,
    finiteness, domain, a replay) or a site tempered by bounded aggregation means the result is not the plain
    aggregate of every admitted client's own site, so the run does not end as a silent success. The result
    itself is the server's last good one (the refused messages never entered it, the bounded sites only up to
    their bounds).

    :ivar clients: ``{client id: [incident, …]}``, each incident a dict with ``round`` (0: the registration
        round, ``r``: ``history[r - 1]``), ``action`` (``"rejected"`` or ``"clipped"``) and ``reason``.
    :ivar result: the server logic holding the last good posterior and the history, when there is one.
    """

    def __init__(self, message, clients=None, result=None):
        super().__init__(message)
        self.clients = dict(clients or {})
        self.result = result


class TransportError(PosteriorCorrectionError, ConnectionError):
    """A federated client or server could not reach its peer, or lost the connection (the cross-process
    transport, :mod:`numpyro_pc.federated.flower`). The message says which address, what the transport
    reported and what to check.

    :ivar address: the server address, when known.
    :ivar details: the transport's own report (the gRPC status and details), when there is one.
    """

    def __init__(self, message, address=None, details=None):
        super().__init__(message)
        self.address = address
        self.details = details


class TransportSecurityError(TransportError):
    """TLS or authentication failed between a federated client and its server: a client without the CA
    certificate (or with another CA's) talking to a TLS server, a server certificate that does not name the
    address the client dials, a certificate file that cannot be read, or a peer the server does not
    authenticate. The message names the fix (which file to pass to which option)."""
