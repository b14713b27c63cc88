"""Shared fixtures: scoped float64, seeded data and small models."""

import gc
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from hypothesis import HealthCheck, settings


def _persistent_compilation_cache():
    """Keep every compiled program on disk for the test session (``.pytest_cache/jax``, or
    ``$NUMPYRO_PC_TEST_JAX_CACHE``; ``0`` turns it off). The fixtures below drop the in-memory
    programs after each module to bound memory, and many modules compile the same programs
    (the same small models, solvers and site kernels): with 2 workers and an empty cache
    tests/test_ef_adapt.py takes 114 s instead of 236 s, though a whole first run gains nothing
    (other files got slower by as much); a second run on the same machine is faster (the demo's
    tests 157 s → 60 s).
    A program's key is its HLO, compile options and the JAX version, so an edited package never
    reads a stale entry."""
    # the harness decides, not the package's default (numpyro_pc.compilation_cache), here and in the
    # processes tests start (the demo, scripts): they would otherwise fill the user's cache folder
    os.environ["NUMPYRO_PC_NO_COMPILATION_CACHE"] = "1"
    folder = os.environ.get("NUMPYRO_PC_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent
                                                              / ".pytest_cache" / "jax"))
    if folder in ("", "0") or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_persistent_compilation_cache()

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
    tests/test_expfam_mixed.py, peak RSS 3.45 GB → 1.40 GB for 30 % more time. Doing it for every
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


def logistic_model(X, y=None):
    """Bayesian logistic regression with an intercept: b ~ N(0,1), w ~ N(0, I)."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def linear_model(X, y=None, noise=0.5, prior_scale=2.0):
    """Conjugate Bayesian linear regression with known noise."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)


def scale_model(X, y=None):
    """Linear regression with a HalfNormal noise scale (a constrained latent)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def make_logistic(n, d, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) / np.sqrt(d) * 2.0
    w = rng.normal(size=d)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-(X @ w + 0.3)))).astype(float)
    return jnp.asarray(X), jnp.asarray(y)


def make_linear(n, d, seed=0, noise=0.5):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    y = X @ w + noise * rng.normal(size=n)
    return jnp.asarray(X), jnp.asarray(y)


def vb_optimality_gap(model, args, post, nodes=30, kwargs=None):
    """Relative violation of the Gaussian VB optimality conditions ``E_q[∇ℓ] = 0`` and
    ``S = E_q[∇²ℓ]`` (ℓ the whole negative log joint) by brute-force tensor Gauss–Hermite
    quadrature over all of ``z`` — an oracle independent of the package's expectation rules,
    for models with ``d ≤ 3``. Returns ``(mean_gap, precision_gap)``.
    """
    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.solvers.start import negative_log_joint

    spec, data = bind_model(model, args, kwargs or {})
    d = spec.latent.dim
    weights = jnp.ones(spec.num_examples, jnp.float64)
    f = lambda z: negative_log_joint(spec, z, data, weights)  # noqa: E731
    xi, w = np.polynomial.hermite_e.hermegauss(nodes)
    grid = np.stack([g.ravel() for g in np.meshgrid(*([xi] * d), indexing="ij")], 1)
    weight = np.prod(np.stack([g.ravel() for g in np.meshgrid(*([w] * d), indexing="ij")], 1), 1)
    weight = jnp.asarray(weight / (2 * np.pi) ** (d / 2))
    points = post.mean[None, :] + jnp.asarray(grid) @ jnp.linalg.cholesky(post.covariance).T
    grads = jax.lax.map(jax.grad(f), points, batch_size=4096)
    hessians = jax.lax.map(jax.hessian(f), points, batch_size=4096)
    g = weight @ grads
    h = jnp.einsum("k,kab->ab", weight, hessians)
    scale = float(weight @ jnp.linalg.norm(grads, axis=1))
    return float(jnp.linalg.norm(g)) / scale, float(jnp.linalg.norm(post.precision - h) / jnp.linalg.norm(h))


def pytest_configure(config):
    """Per-file progress lines on the process that reports (not on xdist workers)."""
    if not hasattr(config, "workerinput"):
        from progress_plugin import FileProgress

        config.pluginmanager.register(FileProgress(config), "numpyro_pc_file_progress")
