"""Options of the public entry points (numpyro_pc.options): anything a user can pass either works
or raises a package error (issue 32: "every user-reachable exception is a package error").

A property test: hypothesis draws values of every type that users get wrong — strings, floats
where counts go, NaN, inf, negative numbers, None, lists — for each option of fit, update,
delete, refine, LOO, merge, sample and save, and any exception must subclass
``PosteriorCorrectionError``.
"""

import jax
import numpy as np
import pytest
from numpyro.infer.autoguide import AutoNormal
from hypothesis import given
from hypothesis import strategies as st

import numpyro_pc as pc
from numpyro_pc import errors, options

from models import logistic_model, make_logistic

_VALUES = st.one_of(st.sampled_from([None, "x", "", np.nan, np.inf, -np.inf, -1, 0, 1, 2.5, -2.5, 1e300, True,
                                     [1.5], [-1], (), {}, np.array([[1]]), np.array([1, 2]), b"x", 2**40, 2**70,
                                     object()]),
                    st.integers(-10, 10), st.floats(allow_nan=True, allow_infinity=True))

_GUIDE = AutoNormal(logistic_model)


def _guide_params(post):
    """AutoNormal parameters at the fitted posterior's mean and marginal standard deviations."""
    mean, sd = np.asarray(post.mean), np.sqrt(np.diag(np.asarray(post.covariance)))
    return {"b_auto_loc": mean[0], "b_auto_scale": sd[0], "w_auto_loc": mean[1:], "w_auto_scale": sd[1:]}


_CALLS = {
    "fit": (("tol", "max_iters", "num_samples", "num_nodes", "chunk_size", "seed", "family", "expectation",
             "curvature", "storage", "init", "rank", "progress", "raise_on_failure", "data_plate", "shared", "solver"),
            lambda post, X, y, kw: pc.fit(logistic_model, X, y, **kw)),
    "dual_form": (("tol", "max_iters", "num_samples", "num_nodes", "chunk_size", "seed", "expectation", "curvature",
                   "storage", "refine", "progress", "raise_on_failure", "data_plate", "shared", "solver"),
                  lambda post, X, y, kw: pc.dual_form(logistic_model, _GUIDE, _guide_params(post), X, y, **kw)),
    "update": (("tol", "max_iters", "seed", "correction", "memory", "selection", "keep", "batch_fraction", "epochs"),
               lambda post, X, y, kw: post.update(X[:4], y[:4], **kw)),
    "delete": (("ids", "method", "damping", "tol", "max_iters"),
               lambda post, X, y, kw: post.delete(**{"ids": [0], **kw})),
    "refine": (("tol", "max_iters", "step_size"), lambda post, X, y, kw: post.refine(**kw)),
    "loo": (("method", "where", "good_k", "tol", "max_iters"), lambda post, X, y, kw: pc.loo(post, **kw)),
    "merge": (("alphas", "method", "posteriors"),
              lambda post, X, y, kw: pc.merge(None, kw.pop("posteriors", [post, post]), **kw)),
    "sample": (("key", "num_samples"),
               lambda post, X, y, kw: post.sample(kw.get("key", jax.random.PRNGKey(0)), kw.get("num_samples", 3))),
}


@pytest.fixture(scope="module")
def fitted():
    with jax.enable_x64(True):
        X, y = make_logistic(40, 2, seed=1)
        yield pc.fit(logistic_model, X, y), X, y


@pytest.mark.parametrize("call", sorted(_CALLS))
@given(data=st.data())
def test_bad_options_raise_only_package_errors(fitted, x64, call, data):
    post, X, y = fitted
    names, run = _CALLS[call]
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
    kwargs = {name: data.draw(_VALUES, label=name) for name in chosen}
    try:
        run(post, X, y, dict(kwargs))
    except errors.PosteriorCorrectionError:
        pass


def test_save_needs_a_path(fitted):
    post, _, _ = fitted
    with pytest.raises(errors.InvalidOptionError, match="must be a str or os.PathLike file path; got 3"):
        post.save(3)


@pytest.mark.parametrize("value, message", [(-1.0, "finite positive"), (np.nan, "finite positive"),
                                            ("1e-8", "finite positive")])
def test_a_tolerance_outside_its_range_is_refused_even_where_unused(fitted, value, message):
    """remove_site runs no solver, but a meaningless tol is still a mistake worth saying."""
    post, _, _ = fitted
    with pytest.raises(errors.InvalidOptionError, match=message):
        post.delete([0], tol=value)


def test_counts_are_never_rounded():
    assert options.check_count(3, "n") == 3
    with pytest.raises(errors.InvalidOptionError, match=r"integer in \[1, 2147483647\] or None; got 2.5"):
        options.check_count(2.5, "n")
    with pytest.raises(errors.InvalidOptionError):
        options.check_count(True, "n")


def test_solver_options_are_one_group_of_the_flat_keywords(fitted, x64):
    """``solver=SolverOptions(...)`` is the flat ``tol``/``max_iters``/``progress``/``raise_on_failure``:
    the same iterates (bit-identical), the group's budget obeyed (2 iterations, where the default
    runs to convergence), two spellings at once refused, values checked when the group is built."""
    _, X, y = fitted
    with pytest.warns(RuntimeWarning, match="max_iters=2 reached"):
        grouped = pc.fit(logistic_model, X, y, solver=pc.SolverOptions(max_iters=2, raise_on_failure=False))
    with pytest.warns(RuntimeWarning, match="max_iters=2 reached"):
        flat = pc.fit(logistic_model, X, y, max_iters=2, raise_on_failure=False)
    assert grouped.record["iterations"] == flat.record["iterations"] == 2
    np.testing.assert_array_equal(grouped.mean, flat.mean)
    np.testing.assert_array_equal(grouped.precision, flat.precision)
    with pytest.raises(errors.InvalidOptionError, match="given twice"):
        pc.fit(logistic_model, X, y, tol=1e-9, solver=pc.SolverOptions())
    with pytest.raises(errors.InvalidOptionError, match="SolverOptions"):
        pc.dual_form(logistic_model, _GUIDE, {}, X, y, solver={"tol": 1e-9})
    with pytest.raises(errors.InvalidOptionError, match="max_iters"):
        pc.SolverOptions(max_iters=0)
    assert repr(pc.SolverOptions()) == "SolverOptions(tol=None, max_iters=None, progress=False, raise_on_failure=True)"


@pytest.mark.slow  # 9 s at load 6 (measured alone)
def test_update_delete_and_refine_take_the_solver_group_for_every_posterior(fitted, x64):
    """The same group on the adaptations of both kinds of posterior: the grouped and the flat call give
    identical results (the group's ``tol``/``max_iters`` reach the solve), two spellings are refused, and
    an option the method has not (a deletion shows no progress bar) is refused rather than dropped."""
    import inspect

    from models import beta_bernoulli, beta_guide

    post, X, y = fitted
    group = pc.SolverOptions(tol=1e-6, max_iters=40)
    a = post.update(X[:5], y[:5], solver=group)
    b = post.update(X[:5], y[:5], tol=1e-6, max_iters=40)
    np.testing.assert_array_equal(a.mean, b.mean)
    c = post.delete([0, 1], method="corrected", solver=group)
    np.testing.assert_array_equal(c.mean, post.delete([0, 1], method="corrected", tol=1e-6, max_iters=40).mean)
    loose = post.update(X[:5], y[:5], correction="none")
    np.testing.assert_array_equal(loose.refine(solver=group).mean, loose.refine(tol=1e-6, max_iters=40).mean)
    with pytest.raises(errors.InvalidOptionError, match="given twice"):
        post.update(X[:5], y[:5], tol=1e-9, solver=group)
    with pytest.raises(errors.InvalidOptionError, match="no option 'progress'"):
        post.delete([0], solver=pc.SolverOptions(progress=True))
    assert "solver" in inspect.signature(type(post).update).parameters  # documented where users look
    ys = jax.numpy.asarray(np.random.default_rng(0).uniform(size=20) < 0.3, float)
    ef = pc.dual_form(beta_bernoulli, beta_guide, {"a": jax.numpy.array(1.0), "b": jax.numpy.array(1.0)}, ys)
    grouped = ef.update(ys[:4], solver=pc.SolverOptions(tol=1e-10))
    np.testing.assert_array_equal(grouped.natural, ef.update(ys[:4], tol=1e-10).natural)
    np.testing.assert_array_equal(ef.delete([0], method="corrected", solver=pc.SolverOptions(tol=1e-10)).natural,
                                  ef.delete([0], method="corrected", tol=1e-10).natural)
    with pytest.raises(errors.InvalidOptionError, match="given twice"):
        ef.refine(max_iters=3, solver=pc.SolverOptions())
