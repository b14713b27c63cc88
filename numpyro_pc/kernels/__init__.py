"""Pure, jit-compiled kernels over pytree state: the streaming state and the site tables (SAGA/SAG), for loops
that stay on the device.
"""
