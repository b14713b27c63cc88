"""The demo runs end to end on the embedded dataset and reports a converged dual form; the command line's
parser imports none of it."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numpyro_pc.demos.run
from numpyro_pc.cli import SECTIONS, demo
from numpyro_pc.errors import InvalidOptionError


# The demo in three parts that xdist can run side by side (make demo runs it whole): every section
# is run through demo() itself, with its printed table, its figure and the claims it makes.
_PARTS = {  # together: every section
    "fit_and_criticism": ("dual_form", "trust", "hierarchical", "criticism"),
    "streaming": ("streaming",),
    "merging_expfam_gp": ("merging_federated", "expfam", "streaming_gp"),
}


@pytest.mark.parametrize("part", sorted(_PARTS))
def test_demo_fast(part, tmp_path, capsys):
    result = demo(out=tmp_path, fast=True, svi_steps=300, sections=_PARTS[part])
    printed = capsys.readouterr().out
    assert set(_PARTS[part]) - {"dual_form"} <= set(result) and not set(SECTIONS) - set(_PARTS[part]) & set(result)
    if part == "fit_and_criticism":
        assert result["residual_before"] > 1e-3 > 1e-8 > result["residual_after"]
        assert abs(result["kl_fit"]) < 1e-8  # pc.fit without SVI reaches the same fixed point
        assert (tmp_path / "dual_form.png").stat().st_size > 10_000
        assert "KL(SVI guide" in printed and "residual" in printed
        assert result["trust"]["residual"] < 1e-8 and "plate 'data' keeps size" in result["trust"]["refused"]
        assert "row 100: 2.0" in result["trust"]["support_refused"]
        hierarchical = result["hierarchical"]  # a centred hierarchy from the ELBO start, updated exactly
        assert hierarchical["start"] == "elbo" and hierarchical["residual"] < 1e-8 and hierarchical["update_kl"] < 1e-8
        assert hierarchical["local_residual"] < 1e-8 and hierarchical["local_update_kl"] < 1e-8  # theta inside the plate
        criticism = result["criticism"]  # all-N LOO: finite, the richer model preferred, refits of the flagged ones
        assert np.isfinite(criticism["elpd_loo"]) and criticism["best"] == "30 features"
        assert np.isfinite(criticism["refitted_elpd"]) and (tmp_path / "criticism.png").stat().st_size > 10_000
    elif part == "streaming":
        stream = {label: kl for label, kl, _ in result["streaming"]["stream"]}
        assert stream["exact"] < 1e-8 < stream["none"]  # exact streaming recovers the batch posterior
        assert stream["stochastic"] < 1e-6
        assert stream["kprior (10 %)"] < stream["memory (10 %)"] < stream["none"]  # a memory kept per batch helps
        # a policy that fell back is marked in the table and explained under it, with the batches it happened at
        marked = sorted(label.split()[0] for label in stream if label.endswith("*"))
        assert marked == sorted(result["streaming"]["fallbacks"])
        assert all(f"* {name}: at batch(es)" in printed for name in marked)
        deletion = {method: kl for method, kl, _ in result["streaming"]["delete"]}
        assert deletion["corrected"] < 1e-8 and deletion["remove_site"] < deletion["tracin"]
        changed = {label.split()[0]: kl for label, kl, _ in result["streaming"]["prior_change"]}
        assert changed["exact"] < 1e-8 < changed["kprior,"] < changed["prior"]  # a memory helps, the exact change is the refit
        assert (tmp_path / "streaming.png").stat().st_size > 10_000
    else:
        merged = dict(result["merging_federated"]["merge"])
        assert merged["bayesian"] < merged["task_arithmetic"]
        fed = {name: (kl, status) for name, _, kl, _, status in result["merging_federated"]["federated"]}
        # FedPC with its default ρ and with the floor ρ = 0.5 that diverged here before the safeguard
        assert all(fed[name][0] < 1e-8 and fed[name][1] == "converged" for name in ("fedpc", "fedpc ρ=0.5", "pvi"))
        assert not [line for line in printed.splitlines() if line.startswith("fedpc") and "diverged" in line]
        skew = {name: (kl, status) for name, _, kl, status in result["merging_federated"]["label_skew"]}
        assert skew["line search (default)"][0] < 1e-8 and skew["line search (default)"][1] == "converged"
        assert (tmp_path / "merging_federated.png").stat().st_size > 10_000
        assert (tmp_path / "expfam.png").stat().st_size > 10_000
        expfam = result["expfam"]  # LOO from the cavities agrees with exact refits of the least reliable examples
        assert expfam["loo_refit_gap"] < 1e-3 and expfam["loo_max_khat"] < 0.7 and np.isfinite(expfam["elpd_loo"])
        # no data rows held: frozen Normal–Gamma sites (they depend on q) cost a small, measured KL (1.1e-3);
        # leaving the frozen sites out of the fixed point would lose two thirds of the data (KL ≫ 1)
        assert 1e-6 < expfam["keep_none_kl"] < 1e-2
        assert (tmp_path / "streaming_gp.png").stat().st_size > 10_000  # streaming sparse GP section


def test_the_parts_cover_every_section():
    assert sorted(sum(_PARTS.values(), ())) == sorted(SECTIONS)


def test_demo_refuses_an_unknown_section(tmp_path):
    with pytest.raises(InvalidOptionError, match="unknown demo section"):
        demo(out=tmp_path, sections=("dual_form", "nonsense"))


def test_the_package_version_is_the_installed_distribution_version():
    from importlib import metadata

    import numpyro_pc

    assert numpyro_pc.__version__ == metadata.version("numpyro-pc")


def test_the_sections_the_parser_offers_are_the_ones_the_runner_runs_in_that_order():
    # the command line takes the names from numpyro_pc.demos without importing the runner: the runner's
    # ``if "<section>" in chosen:`` branches, in order, are those names, and each imports a module that exists
    tree = ast.parse(Path(numpyro_pc.demos.run.__file__).read_text())
    demo_def = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "demo")
    branches = [node for node in ast.walk(demo_def) if isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Constant) and isinstance(node.test.ops[0], ast.In)
                and isinstance(node.test.comparators[0], ast.Name) and node.test.comparators[0].id == "chosen"]
    assert tuple(branch.test.left.value for branch in branches) == SECTIONS
    assert numpyro_pc.demos.run.SECTIONS is SECTIONS
    for branch in branches:  # the section's module is imported in its branch, and only there
        imported = [node.module for child in branch.body for node in ast.walk(child) if isinstance(node, ast.ImportFrom)]
        assert imported and all(module.startswith("numpyro_pc.demos.") for module in imported), branch.test.left.value
        assert all(importlib.util.find_spec(module) is not None for module in imported)


_HEAVY = ("arviz", "sklearn", "optax", "gpjax", "matplotlib")


@pytest.mark.gate  # 13 s (a fresh interpreter importing JAX), but CI must keep the help light
def test_the_help_imports_no_demo_section_and_none_of_its_extras():
    env = dict(os.environ, NUMPYRO_PC_NO_COMPILATION_CACHE="1")
    out = subprocess.run([sys.executable, "-m", "numpyro_pc", "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "demo" in out.stdout, out.stderr
    code = ("import sys, numpyro_pc.cli\n"
            "for argv in (['--help'], ['demo', '--help']):\n    try:\n        numpyro_pc.cli.main(argv)\n    except SystemExit:\n        pass\n"
            f"print(sorted(m for m in sys.modules if m.startswith('numpyro_pc.demos.') or m.split('.')[0] in {_HEAVY}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    *usage, imported = out.stdout.strip().splitlines()
    assert all(section in "\n".join(usage) for section in SECTIONS)  # the choices of --section
    assert imported == "[]"
