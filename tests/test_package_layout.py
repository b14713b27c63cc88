"""The package's folders: the old module names of the flat layout, the packages that took a
module's name, and the size rules the layout keeps (docs/architecture.md, "Layers")."""

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import numpyro_pc
from numpyro_pc import KEPT_MODULE_NAMES, MOVED_MODULES

PACKAGE = Path(numpyro_pc.__file__).resolve().parent

# the packages that took the name of a module of the flat layout, and the module whose API they re-export
_RENAMED_TO_PACKAGE = {"sites": "gaussian", "solvers": "gaussian", "families": "registry", "curvature": "stores",
                       "guides": "gaussian", "dual": "base", "io": "save_load", "datasets": "loaders",
                       "posteriordb": "reference"}


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_module_of_the_flat_layout_imports_under_its_old_name_with_a_warning(old):
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"{old} moved to {MOVED_MODULES[old]}"):
        module = importlib.import_module(old)
    assert module is new  # one module object: patching either name patches both
    assert module.__spec__.name == MOVED_MODULES[old]  # the alias did not rename the real module


def test_the_old_names_cover_every_module_that_moved():
    flat = {f"numpyro_pc.{name}" for name in _RENAMED_TO_PACKAGE}
    moved = set(MOVED_MODULES) | set(KEPT_MODULE_NAMES) | flat
    # every module of the new folders is reachable from an old name, except the ones that are new
    new_modules = {"numpyro_pc.demos.run", "numpyro_pc.demos.models", "numpyro_pc.demos.dual_form",
                   "numpyro_pc.demos.trust", "numpyro_pc.demos.hierarchical", "numpyro_pc.demos.streaming",
                   "numpyro_pc.demos.criticism"}
    targets = set(MOVED_MODULES.values()) | set(KEPT_MODULE_NAMES.values()) | {f"numpyro_pc.{p}.{m}" for p, m in _RENAMED_TO_PACKAGE.items()}
    folders = ("protocols", "model", "families", "curvature", "sites", "solvers", "guides", "dual", "ops", "kernels",
               "io", "datasets", "posteriordb", "demos")
    on_disk = {f"numpyro_pc.{folder}.{path.stem}" for folder in folders for path in (PACKAGE / folder).glob("*.py")
               if path.stem != "__init__"}
    assert on_disk - targets == new_modules
    assert len(moved) == len(MOVED_MODULES) + len(KEPT_MODULE_NAMES) + len(flat)


@pytest.mark.parametrize("package, module", sorted(_RENAMED_TO_PACKAGE.items()))
def test_a_package_that_took_a_module_name_re_exports_its_api(package, module):
    pkg = importlib.import_module(f"numpyro_pc.{package}")
    sub = importlib.import_module(f"numpyro_pc.{package}.{module}")
    assert sub.__all__ and set(pkg.__all__) == set(sub.__all__)
    for name in sub.__all__:
        assert getattr(pkg, name) is getattr(sub, name), name


@pytest.mark.parametrize("old_module, name, new_module", [
    ("numpyro_pc.dual", "build_posterior", "numpyro_pc.dual.build"),
    ("numpyro_pc.dual.expfam", "fit_ef", "numpyro_pc.dual.expfam_fit"),
    ("numpyro_pc.dual.expfam", "dual_form_ef", "numpyro_pc.dual.expfam_fit"),
])
def test_a_name_that_moved_between_modules_still_answers_with_a_warning(old_module, name, new_module):
    with pytest.warns(FutureWarning, match=f"{new_module}.{name}"):
        value = getattr(importlib.import_module(old_module), name)
    assert value is getattr(importlib.import_module(new_module), name)
    with pytest.raises(AttributeError, match="never_defined"):
        getattr(importlib.import_module(old_module), "never_defined")


def test_the_top_level_holds_few_modules_and_no_module_is_long():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_importing_the_package_imports_no_optional_extra_and_uses_no_old_name():
    code = ("import sys, warnings; warnings.simplefilter('error', FutureWarning); import numpyro_pc; "
            "print(sorted(m for m in ('gpjax', 'flwr', 'matplotlib') if m in sys.modules)); import numpyro_pc.cli; "
            "print(sorted(m for m in ('gpjax', 'flwr') if m in sys.modules))")
    env = dict(os.environ, NUMPYRO_PC_NO_COMPILATION_CACHE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["[]", "[]"]  # and neither the package nor the command line touched an old name


@pytest.mark.parametrize("name", ["ef_sites", "likelihood", "expectations"])
def test_an_old_module_as_an_attribute_of_the_package_warns_and_is_the_module(name):
    sys.modules.pop(f"numpyro_pc.{name}", None)
    vars(numpyro_pc).pop(name, None)  # an import under the old name (another test) binds it on the package
    with pytest.warns(FutureWarning, match=f"numpyro_pc.{name} moved to"):
        module = getattr(numpyro_pc, name)
    assert module is importlib.import_module(MOVED_MODULES[f"numpyro_pc.{name}"])
    with pytest.raises(AttributeError, match="never_defined"):
        numpyro_pc.never_defined


@pytest.mark.parametrize("old, new", sorted(KEPT_MODULE_NAMES.items()))
def test_a_module_that_stays_a_public_name_imports_under_it_without_a_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert importlib.import_module(old) is importlib.import_module(new)


@pytest.mark.parametrize("old_module, name, new", [
    ("numpyro_pc.sites.expfam", "blr_solve", "numpyro_pc.solvers.expfam"),
    ("numpyro_pc.sites.expfam", "SolveInfo", "numpyro_pc.solvers.expfam"),
    ("numpyro_pc.curvature", "Factor", "numpyro_pc.curvature.stores"),
    ("numpyro_pc.gp.corrected", "Sites", "numpyro_pc.gp.corrected"),
    ("numpyro_pc.gp", "StreamConfig", "numpyro_pc.gp.core"),
])
def test_a_renamed_or_moved_name_answers_with_a_warning(old_module, name, new):
    if old_module.startswith("numpyro_pc.gp"):
        pytest.importorskip("gpjax", reason="the gp extra (GPJax) is not installed")
    with pytest.warns(FutureWarning, match=name):
        value = getattr(importlib.import_module(old_module), name)
    renamed = {"Factor": "JacobianFactor", "Sites": "FunctionSites", "StreamConfig": "GPStreamConfig"}.get(name, name)
    assert value is getattr(importlib.import_module(new), renamed)
    with pytest.raises(AttributeError, match=f"module '{old_module}' has no attribute 'never_defined'"):
        getattr(importlib.import_module(old_module), "never_defined")
