"""Figure output shared by the demos (``python -m numpyro_pc demo``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["save_figure"]


def save_figure(fig, out, name, dpi=120) -> Path:
    """Write ``fig`` to ``out/name`` (creating ``out``), close it, say where, and return the path.

    :param fig: a Matplotlib figure.
    :param out: output folder.
    :param str name: file name, e.g. ``"streaming.png"``.
    :param int dpi: resolution.
    """
    import matplotlib.pyplot as plt

    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    print(f"\nplot written to {path.resolve()}")
    return path
