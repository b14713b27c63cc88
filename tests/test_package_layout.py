"""The package's folders: the old module names of the flat layout, the packages that took a
module's name, and the size rules the layout keeps (docs/architecture.md, "Layers")."""

import functools
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from models import beta_bernoulli, logistic_model, make_logistic

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
                   "numpyro_pc.demos.criticism", "numpyro_pc.protocols.records", "numpyro_pc.model.probes",
                   "numpyro_pc.dual.marginals", "numpyro_pc.model.locals", "numpyro_pc.model.local_binding",
                   "numpyro_pc.solvers.hessian", "numpyro_pc.families.newton_cg", "numpyro_pc.ops.kprior",
                   "numpyro_pc.model.prediction_matching", "numpyro_pc.ops.boosting", "numpyro_pc.ops.prior_change",
                   "numpyro_pc.model.analysis_memo"}
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
    ("numpyro_pc.gp", "bucket_size", "numpyro_pc.gp.model"),
    ("numpyro_pc.protocols.family", "ExponentialFamily", "numpyro_pc.protocols.family"),
    ("numpyro_pc.families.registry", "ExponentialFamily", "numpyro_pc.protocols.family"),
    ("numpyro_pc.families", "ExponentialFamily", "numpyro_pc.protocols.family"),
])
def test_a_renamed_or_moved_name_answers_with_a_warning(old_module, name, new):
    if old_module.startswith("numpyro_pc.gp"):
        pytest.importorskip("gpjax", reason="the gp extra (GPJax) is not installed")
    with pytest.warns(FutureWarning, match=name):
        value = getattr(importlib.import_module(old_module), name)
    renamed = {"Factor": "JacobianFactor", "Sites": "FunctionSites", "StreamConfig": "GPStreamConfig",
               "bucket_size": "gp_batch_bucket", "ExponentialFamily": "GaussianFamily"}.get(name, name)
    assert value is getattr(importlib.import_module(new), renamed)
    with pytest.raises(AttributeError, match=f"module '{old_module}' has no attribute 'never_defined'"):
        getattr(importlib.import_module(old_module), "never_defined")


# Every way of reaching an old name, as user code writes it: the FutureWarning names the line here that used it,
# not a line of the package or of importlib (the forwarders count their frames: stacklevel)
def _import_old_module():
    import numpyro_pc.likelihood  # noqa: F401


def _from_package_import_old_module():
    from numpyro_pc import likelihood  # noqa: F401


def _from_old_module_import_name():
    from numpyro_pc.likelihood import prior_loss  # noqa: F401


def _from_package_import_moved_name():
    from numpyro_pc.dual import build_posterior  # noqa: F401


def _from_module_import_moved_name():
    from numpyro_pc.dual.expfam import fit_ef  # noqa: F401


def _from_package_import_renamed_class():
    from numpyro_pc.curvature import Factor  # noqa: F401


def _from_posteriordb_import_renamed_class():
    from numpyro_pc.posteriordb import Posterior  # noqa: F401


def _from_gp_import_renamed_class():
    from numpyro_pc.gp import StreamConfig  # noqa: F401


def _from_registry_import_renamed_protocol():
    from numpyro_pc.families.registry import ExponentialFamily  # noqa: F401


def _call_expected_site_values():
    post = _gaussian_posterior()
    numpyro_pc.ops.diagnostics.expected_site_values(post.sites, post.mean, post.covariance)


@functools.cache
def _gaussian_posterior():
    X, y = make_logistic(12, 2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return numpyro_pc.fit(logistic_model, X, y)


@functools.cache
def _beta_posterior():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return numpyro_pc.fit(beta_bernoulli, y=np.array([1.0, 0.0, 1.0, 1.0]), family={"p": "beta"})


_OLD_NAME_USES = {
    "import numpyro_pc.<old>": _import_old_module,
    "importlib.import_module('numpyro_pc.<old>')": lambda: importlib.import_module("numpyro_pc.likelihood"),
    "pc.<old>": lambda: numpyro_pc.likelihood,
    "from numpyro_pc import <old>": _from_package_import_old_module,
    "from numpyro_pc.<old> import name": _from_old_module_import_name,
    "numpyro_pc.dual.build_posterior": lambda: numpyro_pc.dual.build_posterior,
    "from numpyro_pc.dual import build_posterior": _from_package_import_moved_name,
    "numpyro_pc.dual.expfam.fit_ef": lambda: numpyro_pc.dual.expfam.fit_ef,
    "from numpyro_pc.dual.expfam import fit_ef": _from_module_import_moved_name,
    "numpyro_pc.io.validation.check_manifest": lambda: numpyro_pc.io.validation.check_manifest,
    "numpyro_pc.sites.expfam.blr_solve": lambda: numpyro_pc.sites.expfam.blr_solve,
    "numpyro_pc.curvature.Factor": lambda: numpyro_pc.curvature.Factor,
    "from numpyro_pc.curvature import Factor": _from_package_import_renamed_class,
    "numpyro_pc.curvature.stores.Factor": lambda: numpyro_pc.curvature.stores.Factor,
    "numpyro_pc.posteriordb.Posterior": lambda: numpyro_pc.posteriordb.Posterior,
    "from numpyro_pc.posteriordb import Posterior": _from_posteriordb_import_renamed_class,
    "numpyro_pc.gp.StreamConfig": lambda: numpyro_pc.gp.StreamConfig,
    "numpyro_pc.gp.bucket_size": lambda: numpyro_pc.gp.bucket_size,
    "numpyro_pc.protocols.family.ExponentialFamily": lambda: numpyro_pc.protocols.family.ExponentialFamily,
    "from numpyro_pc.families.registry import ExponentialFamily": _from_registry_import_renamed_protocol,
    "from numpyro_pc.gp import StreamConfig": _from_gp_import_renamed_class,
    "numpyro_pc.ops.expfam_handlers.bind_like": lambda: numpyro_pc.ops.expfam_handlers.bind_like,
    "numpyro_pc.io.expfam.check_ef_manifest": lambda: numpyro_pc.io.expfam.check_ef_manifest,
    "numpyro_pc.gp.corrected.Sites": lambda: numpyro_pc.gp.corrected.Sites,
    "numpyro_pc.ops.diagnostics.expected_site_values": _call_expected_site_values,
    "EFPosterior.residual()": lambda: _beta_posterior().residual(),
    "numpyro_pc.dual.expfam.merge_ef": lambda: numpyro_pc.dual.expfam.merge_ef(_beta_posterior(), _beta_posterior()),
}


@pytest.mark.parametrize("use", sorted(_OLD_NAME_USES))
def test_the_warning_about_an_old_name_names_the_line_that_used_it(use):
    if ".gp" in use:
        pytest.importorskip("gpjax", reason="the gp extra (GPJax) is not installed")
    for module in ("numpyro_pc.dual.expfam", "numpyro_pc.io.validation", "numpyro_pc.sites.expfam",
                   "numpyro_pc.curvature.stores", "numpyro_pc.posteriordb", "numpyro_pc.ops.expfam_handlers",
                   "numpyro_pc.io.expfam", "numpyro_pc.ops.diagnostics",
                   "numpyro_pc.gp.corrected" if ".gp" in use else "json"):
        importlib.import_module(module)  # the new modules, imported before: only the old name is left to warn
    sys.modules.pop("numpyro_pc.likelihood", None)
    vars(numpyro_pc).pop("likelihood", None)  # bound on the package by an earlier import under the old name
    use_it = _OLD_NAME_USES[use]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use_it()
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert future, "no FutureWarning"
    lines = {line for _, _, line in use_it.__code__.co_lines() if line is not None}
    assert [(w.filename, w.lineno in lines) for w in future] == [(__file__, True)] * len(future), \
        [(w.filename, w.lineno) for w in future]


@pytest.mark.parametrize("package, module, name, new", [
    ("numpyro_pc.curvature", "stores", "Factor", "JacobianFactor"),
    ("numpyro_pc.posteriordb", "reference", "Posterior", "ReferencePosterior"),
    ("numpyro_pc.gp", "core", "StreamConfig", "GPStreamConfig"),
])
def test_a_package_warns_about_a_renamed_class_in_the_words_of_its_module(package, module, name, new):
    # the package raises the warning itself (to name the caller's line), with the text of its module's __getattr__
    if package == "numpyro_pc.gp":
        pytest.importorskip("gpjax", reason="the gp extra (GPJax) is not installed")
    messages = []
    for where in (package, f"{package}.{module}"):
        with pytest.warns(FutureWarning) as caught:
            value = getattr(importlib.import_module(where), name)
        messages.append(str(caught[0].message))
        assert value is getattr(importlib.import_module(package), new)
    assert messages[0] == messages[1]
