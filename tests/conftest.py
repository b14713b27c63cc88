"""Shared fixtures: scoped float64, seeded data and small models."""

import gc
import os

import jax
import pytest
from hypothesis import HealthCheck, settings
from jax_cache import use_test_compilation_cache
from tiers import DurationRecorder, mark_slow_tier, recorded_seconds


use_test_compilation_cache()

# Property tests: the default profile is derandomised (the same examples on every run, so a red CI
# run can be reproduced and a green one is not luck); HYPOTHESIS_PROFILE=thorough searches freshly
# drawn examples, 20 times as many, to hunt for new failures before a stop.
_PROPERTY_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("default", derandomize=True, max_examples=30, **_PROPERTY_SETTINGS)
settings.register_profile("thorough", derandomize=False, max_examples=600, **_PROPERTY_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_per_module():
    """Drop JAX's compiled programs after each test module: a worker runs a few hundred tests and
    would otherwise keep every executable (one worker grew to 11.6 GB and was OOM-killed)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _release_compiled_programs_per_test(request):
    """In modules that set ``RELEASE_PROGRAMS_EACH_TEST`` (the exponential-family tests, whose
    programs are large and rarely shared between tests) drop them after every test: measured on
    tests/families/test_expfam_gaussian.py, peak RSS 3.45 GB → 1.40 GB for 30 % more time. Doing it for every
    module cost 5 minutes of the unit suite."""
    yield
    if getattr(request.module, "RELEASE_PROGRAMS_EACH_TEST", False):
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def x64():
    """Run a test in float64 without flipping the global setting for other tests."""
    with jax.enable_x64(True):
        yield


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's seconds to PATH (make test-durations: tests/durations.json)")


def pytest_configure(config):
    """Per-file progress lines and the duration record on the process that reports (not on xdist workers)."""
    if not hasattr(config, "workerinput"):
        from progress_plugin import FileProgress

        config.pluginmanager.register(FileProgress(config), "numpyro_pc_file_progress")
        if config.getoption("record_durations"):
            config.pluginmanager.register(DurationRecorder(config.getoption("record_durations")),
                                          "numpyro_pc_duration_recorder")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Put the tests recorded as slow in the slow tier before ``-m`` selects (tests/tiers.py)."""
    mark_slow_tier(items, recorded_seconds())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say what the tier selection left out, so that a gate run never reads as the whole suite."""
    if "not slow" in (config.getoption("markexpr") or ""):
        terminalreporter.write_line("the slow tier was deselected (make unit-slow runs it; make test-all runs "
                                    "everything; tests/tiers.py says how a test gets there)")
