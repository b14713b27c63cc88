"""Command line: ``python -m numpyro_pc demo`` (also installed as ``numpyro-pc``); the demo itself is
:mod:`numpyro_pc.demos`.

Building the parser imports no demo: the section names are :data:`numpyro_pc.demos.SECTIONS`, and
:mod:`numpyro_pc.demos.run` (which imports a section's module, with its extras, only when the section runs)
is imported when ``demo`` runs, so that ``--help`` is quick and works without the demo's extras.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from numpyro_pc.demos import SECTIONS

if TYPE_CHECKING:
    from numpyro_pc.demos.run import demo

__all__ = ["main", "demo", "SECTIONS"]


def __getattr__(name: str) -> Callable[..., dict]:
    """``numpyro_pc.cli.demo``: :func:`numpyro_pc.demos.run.demo`, imported on first use."""
    if name == "demo":
        from numpyro_pc.demos.run import demo

        return demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numpyro_pc", description="numpyro_pc command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="dual form of a logistic regression on scikit-learn's breast-cancer data")
    p_demo.add_argument("--out", default="demo_output", help="folder for the plots (default: demo_output)")
    p_demo.add_argument("--fast", action="store_true", help="fewer SVI steps, no progress bars")
    p_demo.add_argument("--svi-steps", type=int, default=None, help="SVI steps (default 3000, 500 with --fast)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--section", action="append", choices=SECTIONS, dest="sections",
                        help="run only this section (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from numpyro_pc.demos.run import demo

        demo(out=args.out, fast=args.fast, svi_steps=args.svi_steps, seed=args.seed, sections=args.sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
