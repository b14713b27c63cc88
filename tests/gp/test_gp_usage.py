"""What users expect of a stream: a progress bar that stays off in CI, a plot of the fit with its
inducing inputs and current batch, typed errors, and a persistent compilation cache that makes a
second run of the same script compile nothing."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

gpx = pytest.importorskip("gpjax")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402

from numpyro_pc.errors import (DataShapeError, NonFiniteDataError, NotFittedError,  # noqa: E402
                               PosteriorCorrectionError)
from numpyro_pc.gp import StreamingSparseGP  # noqa: E402
from numpyro_pc.gp.usage import progress, use_progress  # noqa: E402


def test_progress_is_off_in_ci_and_can_be_forced(monkeypatch):
    batches = [1, 2, 3]
    monkeypatch.delenv("NUMPYRO_PC_PROGRESS", raising=False)
    monkeypatch.setenv("CI", "true")
    assert not use_progress()
    assert progress(batches) is batches                      # no bar: the iterable itself
    monkeypatch.setenv("NUMPYRO_PC_PROGRESS", "1")
    assert use_progress()
    bar = progress(batches, total=3)
    assert bar is not batches and hasattr(bar, "set_postfix") and list(bar) == batches
    monkeypatch.setenv("NUMPYRO_PC_PROGRESS", "0")
    assert not use_progress() and use_progress(True)


def _fit(D, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (60, D))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=60)
    sgp = StreamingSparseGP(gpx.kernels.RBF(), 6, noise_variance=0.05, max_iters=10, memory_size=0)
    return sgp.fit_stream([(X[:30], y[:30]), (X[30:], y[30:])], progress=False), X[30:], y[30:]


def test_plot_1d_and_2d_show_inducing_inputs_and_the_batch():
    sgp, X, y = _fit(1)
    assert len(sgp.history) == 2
    ax = sgp.plot(X, y)
    Z = np.asarray(sgp.state.Z)[:, 0]
    xs = [np.asarray(line.get_xdata()) for line in ax.lines]
    assert any(x.shape == Z.shape and np.allclose(x, Z) for x in xs)             # inducing inputs
    assert any(x.shape == (30,) and np.allclose(x, X[:, 0]) for x in xs)          # the current batch
    assert any(isinstance(c, PolyCollection) for c in ax.collections)             # predictive band
    plt.close(ax.figure)

    sgp2, X2, y2 = _fit(2)
    ax = sgp2.plot(X2, y2)
    Z2 = np.asarray(sgp2.state.Z)
    assert any(np.allclose(np.c_[line.get_xdata(), line.get_ydata()], Z2) for line in ax.lines
               if len(line.get_xdata()) == len(Z2))
    offsets = [np.asarray(c.get_offsets()) for c in ax.collections if hasattr(c, "get_offsets")]
    assert any(o.shape == X2.shape and np.allclose(o, X2) for o in offsets)
    plt.close(ax.figure)


def test_plot_and_predict_errors_are_typed():
    unfitted = StreamingSparseGP(gpx.kernels.RBF(), 4)
    with pytest.raises(NotFittedError):
        unfitted.plot()
    with pytest.raises(NotFittedError):
        unfitted.predict(np.zeros((2, 1)))
    with pytest.raises(PosteriorCorrectionError):
        StreamingSparseGP(gpx.kernels.RBF(), 4, bound="nope")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3))
    sgp = StreamingSparseGP(gpx.kernels.RBF(), 4, max_iters=3, memory_size=0).update(X, X[:, 0])
    with pytest.raises(DataShapeError):
        sgp.plot()
    # test inputs: a NaN or infinite row and the wrong number of columns are refused, never predicted as NaN
    with pytest.raises(NonFiniteDataError, match="row 1"):
        sgp.predict(np.array([[0.0, 0.0, 0.0], [np.nan, 0.0, 0.0]]))
    with pytest.raises(NonFiniteDataError):
        sgp.predict_y(np.array([[np.inf, 0.0, 0.0]]))
    with pytest.raises(DataShapeError, match=r"\(N\*, 3\)"):
        sgp.predict(np.zeros((2, 2)))
    one_point, as_row = sgp.predict(X[0]), sgp.predict(X[:1])  # a 1-D input with D > 1 is one point
    np.testing.assert_array_equal(one_point[0], as_row[0])
    line = StreamingSparseGP(gpx.kernels.RBF(), 4, max_iters=3, memory_size=0).update(X[:, :1], X[:, 0])
    np.testing.assert_array_equal(line.predict(X[:5, 0])[0], line.predict(X[:5, :1])[0])  # D = 1: a column


_SCRIPT = textwrap.dedent("""
    import jax, numpy as np, gpjax as gpx
    from numpyro_pc.ops.diagnostics import count_compilations
    from numpyro_pc.gp import StreamingSparseGP, enable_compilation_cache
    enable_compilation_cache()
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (40, 1)); y = np.sin(2 * X[:, 0])
    with count_compilations() as programs:      # programs not in this process's in-memory cache
        sgp = StreamingSparseGP(gpx.kernels.RBF(), 5, noise_variance=0.05, max_iters=5, memory_size=16)
        sgp = sgp.update(X[:20], y[:20]).update(X[20:], y[20:])
        sgp.predict_y(X)
    print("COMPILED", programs.count - len(hits), programs.count)
""")


def test_persistent_cache_second_run_compiles_nothing(tmp_path):
    # every program of the second process comes from the on-disk cache (an XLA compilation is a program
    # that was not a persistent-cache hit)
    env = dict(os.environ, NUMPYRO_PC_JAX_CACHE=str(tmp_path / "cache"), JAX_COMPILATION_CACHE_DIR="")
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append([int(v) for v in out.stdout.split("COMPILED")[-1].split()])
    (compiled1, programs1), (compiled2, programs2) = runs
    assert compiled1 > 0 and os.listdir(tmp_path / "cache")
    assert programs2 == programs1 and compiled2 == 0
