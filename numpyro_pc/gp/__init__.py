"""Streaming sparse Gaussian processes on GPJax (Bui, Nguyen & Turner 2017) with posterior correction.

This subpackage is the only part of :mod:`numpyro_pc` that imports GPJax (the ``gp``
extra, GPJax 1.0). ``import numpyro_pc`` does not import it.

* :class:`StreamingSparseGP` — update / predict / predict_y / state / summary;
* :mod:`~numpyro_pc.gp.bounds` — collapsed VFE and Power-EP bounds in the stable Cholesky form;
* :mod:`~numpyro_pc.gp.uncollapsed` — the uncollapsed bound for non-Gaussian likelihoods;
* :mod:`~numpyro_pc.gp.corrected` — the posterior-corrected variant with a memory;
* :mod:`~numpyro_pc.gp.core` — the functional core (``StreamingGPState`` pytree, pure ``step``, ``lax.scan``-able);
* :mod:`~numpyro_pc.gp.usage` — persistent compilation cache, progress bar, plotting;
* :mod:`~numpyro_pc.gp.datainit` — starting values from the first batch and scale-free optimiser coordinates;
* :mod:`~numpyro_pc.gp.state`, :mod:`~numpyro_pc.gp.inducing`, :mod:`~numpyro_pc.gp.optim`.
"""

from __future__ import annotations

from numpyro_pc.deprecation import warn_renamed

from .bounds import CollapsedFit, collapsed_bound, collapsed_fit, paper_bound
from .core import GPStreamConfig, StreamingGPState
from .core import __getattr__ as _core_getattr
from .model import StreamingSparseGP, gp_batch_bucket
from .state import GPState, Hyper, handover, prior_state
from .uncollapsed import BernoulliLogit, uncollapsed_bound
from .usage import enable_compilation_cache

__all__ = ["StreamingSparseGP", "GPState", "Hyper", "handover", "prior_state", "collapsed_fit", "collapsed_bound",
           "paper_bound", "CollapsedFit", "uncollapsed_bound", "BernoulliLogit", "gp_batch_bucket", "GPStreamConfig",
           "StreamingGPState", "enable_compilation_cache"]


def __getattr__(name: str) -> type:
    if name == "StreamConfig":  # renamed, with a FutureWarning naming the caller's line
        return _core_getattr(name)
    if name == "bucket_size":  # renamed: numpyro_pc.model.rows.bucket_size is the dual-form rows' rule
        warn_renamed("numpyro_pc.gp.bucket_size is now gp_batch_bucket (bucket_size is the dual-form rows' rule, "
                     "numpyro_pc.model.rows.bucket_size, which pads differently); the old name will be removed in "
                     "the next release")
        return gp_batch_bucket  # type: ignore[return-value]  # a function, where the other renames are classes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
