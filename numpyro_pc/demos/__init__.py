"""The demos behind ``python -m numpyro_pc demo`` and their plots (apart from the library: nothing below imports
them).

This module imports nothing: the command line builds its parser from :data:`SECTIONS` without importing the
sections, and :mod:`numpyro_pc.demos.run` imports a section's module only when that section runs.
"""

__all__ = ["SECTIONS"]

#: the demo's sections, in the order :func:`numpyro_pc.demos.run.demo` runs them
SECTIONS = ("dual_form", "trust", "hierarchical", "streaming", "criticism", "merging_federated", "expfam",
            "streaming_gp")
