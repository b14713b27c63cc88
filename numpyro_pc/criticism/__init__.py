"""Model criticism without refits: all-``N`` leave-one-out, leave-future-out and influence.

* :func:`loo` — every example's leave-one-out predictive density from the dual form's
  cavities (:mod:`~numpyro_pc.criticism.cavity` for Gaussian posteriors,
  :mod:`~numpyro_pc.criticism.ef_cavity` for exponential-family products), with a
  per-example reliability ``k̂`` and exact refits where it is large; an ArviZ ``ELPDData``.
* :func:`lfo` — leave-future-out cross-validation by streaming exact updates.
* :func:`influence` — per-example parameter change by site removal, the influence function
  and TracIn, and the change of a user function of the parameters.

See docs/criticism.md.
"""

from __future__ import annotations

from .influence import InfluenceResult, influence
from .lfo import lfo
from .loo import elpd_data, loo
from .pit import loo_log_weights, loo_pit

__all__ = ["loo", "lfo", "influence", "InfluenceResult", "elpd_data", "loo_log_weights", "loo_pit"]
