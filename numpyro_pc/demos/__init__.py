"""The demos behind ``python -m numpyro_pc demo`` and their plots (apart from the library: nothing below imports
them).
"""
