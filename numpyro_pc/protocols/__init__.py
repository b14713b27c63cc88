"""What every implementation meets: the family, site-table and posterior protocols, and the optional capabilities
a family may add.

The bottom layer with :mod:`numpyro_pc.model`: nothing here knows a concrete family, store or posterior.
"""

from __future__ import annotations
