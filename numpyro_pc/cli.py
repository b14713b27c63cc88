"""Command line: ``python -m numpyro_pc demo`` (also installed as ``numpyro-pc``); the demo itself is
:mod:`numpyro_pc.demos`."""

from __future__ import annotations

import argparse
import sys

from numpyro_pc.demos.run import SECTIONS, demo

__all__ = ["main", "demo", "SECTIONS"]


def main(argv=None):
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
        demo(out=args.out, fast=args.fast, svi_steps=args.svi_steps, seed=args.seed, sections=args.sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
