"""Boosting training from a checkpoint (``pc.boost``, paper §4.2) against the unboosted fit.

Oracle: the boosted problem has the fixed point of ``pc.fit`` on the same model and data
(:mod:`numpyro_pc.ops.boosting`), so both are solved to a residual of 1e-12 in float64 and
compared by ``KL < 1e-10`` — well above the ~1e-20 the two solves' rounding leaves, and far
below what the checkpoint alone misses by (asserted too, so that returning the checkpoint fails).
Start values (:func:`~numpyro_pc.ops.boosting.boosted_start`) are checked against the checkpoint's
marginal precision, inverted from its covariance in NumPy (rtol 1e-9 to 1e-10: two inversions of a
well-conditioned 5 × 5 matrix). Every test that fits is in the slow tier: alone on one core each
spends 5–10 s, nearly all of it compiling the fits; the mapping's checks run in the gate.
The speed-up claim is checked as a strict inequality of iteration counts from a same-data
checkpoint fitted loosely (tol 1e-4) against the fit from its MAP/Laplace start: 7 against
10–11 when measured, so the margin is several iterations.
"""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_pc as pc
from numpyro_pc.errors import DataShapeError, IncompatiblePosteriorsError, ModelMismatchError
from numpyro_pc.ops.boosting import boosted_start, checkpoint_map

from models import logistic_model, make_logistic

TOL = 1e-12
N, D = 300, 5


def renamed_model(X, y=None):
    """``logistic_model`` with its weights called ``beta`` and the intercept after them."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def _data():
    return make_logistic(N, D, seed=1)


@pytest.mark.slow  # 5 s per family (measured alone, one core)
@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_a_same_data_checkpoint_reaches_the_fit_in_fewer_iterations(x64, family):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, family=family, tol=TOL)
    checkpoint = pc.fit(logistic_model, X, y, family=family, tol=1e-4)
    boosted = pc.boost(logistic_model, X, y, checkpoint=checkpoint, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert float(checkpoint.kl(fitted)) > 1e-9  # the loose checkpoint is not already the answer
    assert boosted.record["iterations"] < fitted.record["iterations"]
    record = boosted.record
    assert (record["operation"], record["start"]["kind"]) == ("boost", "checkpoint")
    assert (record["mapped"], record["from_prior"], record["checkpoint_examples"]) == (D + 1, 0, N)
    assert record["precision_from_checkpoint"] and record["converged"]
    assert record["start_residual"] == pytest.approx(checkpoint.residual, rel=1e-6)
    assert boosted.family == fitted.family and boosted.sites.num_examples == N


@pytest.mark.slow  # 6 s per family (measured alone, one core)
@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_a_checkpoint_of_half_the_rows_reaches_the_fit_of_all_of_them(x64, family):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, family=family, tol=TOL)
    half = pc.fit(logistic_model, X[: N // 2], y[: N // 2], family=family)
    boosted = pc.boost(logistic_model, X, y, checkpoint=half, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert float(half.kl(fitted)) > 1e-3
    assert boosted.record["checkpoint_examples"] == N // 2


@pytest.mark.slow  # 10 s per family (measured alone, one core)
@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_a_checkpoint_of_a_model_with_one_feature_fewer_reaches_the_fit(x64, family):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, family=family, tol=TOL)
    smaller = pc.fit(logistic_model, X[:, 1:], y, family=family)
    # the checkpoint's w[k] is the new model's w[k + 1]: the new feature is the first
    boosted = pc.boost(logistic_model, X, y, checkpoint=smaller, mapping={"w": np.arange(1, D)}, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert (boosted.record["mapped"], boosted.record["from_prior"]) == (D, 1)


@pytest.mark.slow  # 7 s (measured alone, one core)
def test_the_start_of_a_mapped_checkpoint_is_its_marginal_and_the_prior(x64):
    """The shared coordinates start at the checkpoint's mean and marginal precision (its covariance block
    inverted), the new one at the prior's mean 0 and precision 1, independent of the rest."""
    X, y = _data()
    smaller = pc.fit(logistic_model, X[:, :-1], y, family="full")
    spec, data = pc.bind_model(logistic_model, (X, y), {})
    q = boosted_start(smaller, spec, data, smaller.family, jnp.float64, {"w": np.arange(D - 1)}).start
    cov = np.linalg.inv(np.asarray(smaller.state.precision))
    np.testing.assert_allclose(np.asarray(q.mean)[:D], np.asarray(smaller.state.mean), rtol=0, atol=0)
    assert float(q.mean[D]) == 0.0
    np.testing.assert_allclose(np.asarray(q.precision)[:D, :D], np.linalg.inv(cov), rtol=1e-10)
    assert float(q.precision[D, D]) == 1.0 and not np.any(np.asarray(q.precision)[D, :D])


def no_intercept_model(X, y=None):
    """``logistic_model`` without its intercept ``b``."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.slow  # 9 s (measured alone, one core)
def test_a_checkpoint_site_the_model_lacks_is_marginalised_out(x64):
    """An empty mapping maps the sites of the same name and shape (``w``); the checkpoint's ``b`` is dropped,
    and the start's precision over ``w`` is the checkpoint's marginal one, not its conditional block."""
    X, y = _data()
    fitted = pc.fit(no_intercept_model, X, y, tol=TOL)
    checkpoint = pc.fit(logistic_model, X, y)
    spec, data = pc.bind_model(no_intercept_model, (X, y), {})
    q = boosted_start(checkpoint, spec, data, checkpoint.family, jnp.float64, {}).start
    cov = np.linalg.inv(np.asarray(checkpoint.state.precision))
    np.testing.assert_allclose(np.asarray(q.precision), np.linalg.inv(cov[1:, 1:]), rtol=1e-9)
    assert not np.allclose(np.asarray(q.precision), np.asarray(checkpoint.state.precision)[1:, 1:], rtol=1e-3)
    boosted = pc.boost(no_intercept_model, X, y, checkpoint=checkpoint, mapping={}, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert (boosted.record["mapped"], boosted.record["from_prior"]) == (D, 0)


@pytest.mark.slow  # 9 s (measured alone, one core)
def test_a_renamed_and_reordered_site_is_read_through_the_mapping(x64):
    X, y = _data()
    fitted = pc.fit(renamed_model, X, y, tol=TOL)
    checkpoint = pc.fit(logistic_model, X, y, tol=1e-4)
    boosted = pc.boost(renamed_model, X, y, checkpoint=checkpoint, mapping={"beta": ("w", np.arange(D))}, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert boosted.record["iterations"] < fitted.record["iterations"]


@pytest.mark.slow  # 10 s (measured alone, one core)
def test_a_merge_of_two_half_checkpoints_boosts_the_fit_of_the_union(x64):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, tol=TOL)
    halves = [pc.fit(logistic_model, X[rows], y[rows]) for rows in (slice(0, N // 2), slice(N // 2, N))]
    merged = pc.merge(None, halves)
    boosted = pc.boost(logistic_model, X, y, checkpoint=merged, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert boosted.record["checkpoint_examples"] == N


@pytest.mark.slow  # 5 s (measured alone, one core)
def test_the_isotropic_family_keeps_the_fits_own_precision(x64):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, family="isotropic", tol=TOL)
    checkpoint = pc.fit(logistic_model, X[:100], y[:100], family="isotropic")
    boosted = pc.boost(logistic_model, X, y, checkpoint=checkpoint, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert boosted.record["precision_from_checkpoint"] is False


@pytest.mark.slow  # 5 s (measured alone, one core)
def test_a_checkpoint_whose_solve_fails_falls_back_to_the_fits_start(x64):
    X, y = _data()
    fitted = pc.fit(logistic_model, X, y, tol=TOL)
    checkpoint = pc.fit(logistic_model, X, y)
    diverged = checkpoint.evolve(state=pc.Gaussian(checkpoint.state.mean * jnp.nan, checkpoint.state.precision))
    boosted = pc.boost(logistic_model, X, y, checkpoint=diverged, tol=TOL)
    assert float(boosted.kl(fitted)) < 1e-10
    assert boosted.record["start"]["kind"] == "map"
    assert "the solve from the checkpoint stopped (NonFiniteResultError" in boosted.record["start"]["reason"]


@pytest.mark.slow  # 8 s (measured alone, one core)
def test_boost_refuses_other_latents_without_a_mapping(x64):
    X, y = _data()
    smaller = pc.fit(logistic_model, X[:, :-1], y)
    with pytest.raises(ModelMismatchError, match=r"w: checkpoint \(4,\), model \(5,\).*mapping="):
        pc.boost(logistic_model, X, y, checkpoint=smaller)
    with pytest.raises(DataShapeError, match=r"each of the 4 unconstrained coordinates.*shape \(3,\)"):
        pc.boost(logistic_model, X, y, checkpoint=smaller, mapping={"w": np.arange(3)})


def _latents(model, d):
    X, y = make_logistic(20, d, seed=0)
    return pc.bind_model(model, (X, y), {})[0].latent


def test_a_mapping_of_the_wrong_size_is_refused_with_what_it_expected(x64):
    smaller, larger = _latents(logistic_model, D - 1), _latents(logistic_model, D)
    with pytest.raises(DataShapeError, match=r"each of the 4 unconstrained coordinates.*shape \(3,\)"):
        checkpoint_map(smaller, larger, {"w": np.arange(3)})
    with pytest.raises(DataShapeError, match=r"4 distinct positions in \[0, 5\).*values from 2 to 5"):
        checkpoint_map(smaller, larger, {"w": np.arange(2, 6)})
    with pytest.raises(DataShapeError, match="1 repeated"):
        checkpoint_map(smaller, larger, {"w": np.array([0, 1, 2, 2])})
    with pytest.raises(DataShapeError, match="integers"):
        checkpoint_map(smaller, larger, {"w": np.linspace(0.0, 3.0, 4)})
    with pytest.raises(ModelMismatchError, match="'v', which is not a latent site of the boosted model"):
        checkpoint_map(smaller, larger, {"v": np.arange(4)})
    with pytest.raises(ModelMismatchError, match="checkpoint's site 'beta', which it does not have"):
        checkpoint_map(smaller, larger, {"w": ("beta", np.arange(4))})
    with pytest.raises(ModelMismatchError, match=r"'w' has unconstrained shape \(4,\) in the checkpoint and \(5,\)"):
        checkpoint_map(smaller, larger, {})
    with pytest.raises(DataShapeError, match="a dict"):
        checkpoint_map(smaller, larger, [np.arange(4)])


def test_other_layouts_without_a_mapping_are_refused_with_the_difference(x64):
    with pytest.raises(ModelMismatchError, match=r"w: checkpoint \(4,\), model \(5,\).*mapping=") as err:
        checkpoint_map(_latents(logistic_model, D - 1), _latents(logistic_model, D))
    assert err.value.differences == ("w: checkpoint (4,), model (5,)",)
    with pytest.raises(ModelMismatchError, match="beta: checkpoint absent, model"):
        checkpoint_map(_latents(logistic_model, D), _latents(renamed_model, D))


def test_a_checkpoint_that_is_not_a_gaussian_posterior_is_refused(x64):
    X, y = _data()
    with pytest.raises(IncompatiblePosteriorsError, match="got dict"):
        pc.boost(logistic_model, X, y, checkpoint={"mean": 0})


def test_the_identity_map_of_equal_layouts(x64):
    X, y = _data()
    spec = pc.bind_model(logistic_model, (X, y), {})[0]
    cmap = checkpoint_map(spec.latent, spec.latent)
    assert cmap.identity and cmap.from_prior.size == 0 and cmap.source.tolist() == list(range(D + 1))
    # an explicit mapping that maps every coordinate to itself is the identity too
    assert checkpoint_map(spec.latent, spec.latent, {"w": np.arange(D)}).identity
