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
    any plate, discrete latent sites, or an ambiguous data plate.
    """


class DataShapeError(PosteriorCorrectionError, ValueError):
    """A data argument's leading size disagrees with the data plate."""


class NonFiniteDataError(PosteriorCorrectionError, ValueError):
    """A data argument contains NaN or infinite values."""


class NonFiniteResultError(PosteriorCorrectionError, FloatingPointError):
    """A computation produced NaN or infinite values."""


class NotPositiveDefiniteError(PosteriorCorrectionError, ValueError):
    """A precision (or covariance) matrix is not positive definite."""


class ConvergenceError(PosteriorCorrectionError, RuntimeError):
    """An iterative solver stopped before reaching its tolerance.

    :ivar posterior: the last iterate (a usable object, not at the requested tolerance).
    :ivar history: the per-iteration record of the solver.
    """

    def __init__(self, message, posterior=None, history=None):
        super().__init__(message)
        self.posterior = posterior
        self.history = history


class ExpectationRuleError(PosteriorCorrectionError, ValueError):
    """The requested expectation rule does not apply to this model."""


class SiteStorageError(PosteriorCorrectionError, ValueError):
    """The requested per-example site storage is impossible or too large."""


class UnknownExampleError(PosteriorCorrectionError, KeyError):
    """An example id is not in the posterior (never added, already deleted, or its data was dropped)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class IncompatiblePosteriorsError(PosteriorCorrectionError, ValueError):
    """Posteriors that cannot be combined (different models, latent sites, families or dtypes)."""
