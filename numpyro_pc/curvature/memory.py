"""The machine's memory, and the share of it that automatic choices may fill.

``storage="auto"`` (:func:`numpyro_pc.curvature.storage.resolve_storage`) stores a model's per-example
Hessians dense, ``N·d²`` numbers, only when they factorise no cheaper and their bytes fit
:func:`dense_auto_budget`: 1/8 of the memory this process can have (the physical memory, or
a smaller cgroup limit), or 1 GiB where that cannot be read. The rest of the memory is left
for the copies a fit makes (a chunked site computation's output, the solver's sums) and for
other work on the machine; ``storage="dense"`` accepts any size.
"""

from __future__ import annotations

import os

__all__ = ["machine_memory", "dense_auto_budget", "format_bytes", "DENSE_AUTO_FRACTION", "DENSE_AUTO_FALLBACK"]

DENSE_AUTO_FRACTION = 8  # storage="auto" may choose dense sites that fill up to 1/8 of the machine's memory
DENSE_AUTO_FALLBACK = 2**30  # bytes (2**27 float64 numbers) where the machine's memory cannot be read

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def machine_memory() -> int | None:
    """Bytes of memory this process can have: the physical memory (``os.sysconf``), or a smaller
    cgroup limit (a container's); ``None`` where neither can be read."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # cgroup v2 writes "max" when unlimited; v1 a number near 2**63
            sizes.append(int(text))
    sizes = [size for size in sizes if size > 0]
    return min(sizes) if sizes else None


def dense_auto_budget(memory: int | None) -> int:
    """Bytes of dense per-example curvature that ``storage="auto"`` may choose.

    :param memory: the machine's memory in bytes (:func:`machine_memory`), or ``None``.
    :return: ``memory // 8``, or :data:`DENSE_AUTO_FALLBACK` (``2**30``, 1 GiB) when ``memory`` is ``None``.
    """
    return DENSE_AUTO_FALLBACK if not memory else int(memory) // DENSE_AUTO_FRACTION


def format_bytes(num: float) -> str:
    """``num`` bytes in B, KiB, MiB or GiB, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size:
            return f"{num / size:.3g} {unit}"
    return f"{int(num)} B"
