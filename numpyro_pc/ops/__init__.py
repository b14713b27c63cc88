"""Operations on a fitted posterior: update with a correction (exact, memory, stochastic), delete, merge,
streaming, the NumPyro handlers, and diagnostics.
"""
