"""Function-space memory (``correction="kprior"``) against closed forms and exact corrections.

Oracles: for a canonical-link GLM the prediction-matching correction equals the correction by
the true losses of the same examples (module docstring of :mod:`numpyro_pc.ops.kprior`), so
with every example in memory the update is the exact one, i.e. the batch fit; for linear
regression the label-free loss is the squared prediction mismatch (paper eq. ``corr_linreg``).
Tolerances: KL 1e-10 in float64 (solver tolerance 1e-12 on both sides).
"""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.errors import InvalidOptionError, UnsupportedModelError
from numpyro_pc.model.likelihood import example_loss
from numpyro_pc.model.prediction_matching import prediction_kl, with_matching
from numpyro_pc.ops.kprior import predictions

from models import beta_bernoulli, beta_guide, linear_model, logistic_model, make_linear, make_logistic

TOL = 1e-12


def _task(n=200, d=4, seed=3):
    X, y = make_logistic(n, d, seed=seed)
    return (X[:120], y[:120]), (X[120:], y[120:])


@pytest.mark.parametrize("family", [pytest.param("isotropic", marks=pytest.mark.slow), "diagonal", "full"])
def test_a_glm_with_every_example_in_memory_reaches_the_batch_fit(x64, family):
    (X1, y1), (X2, y2) = _task()
    post = pc.fit(logistic_model, X1, y1, family=family, tol=TOL)
    matched = post.update(X2, y2, correction="kprior", tol=TOL)
    batch = pc.fit(logistic_model, jnp.concatenate([X1, X2]), jnp.concatenate([y1, y2]), family=family, tol=TOL)
    assert float(matched.kl(batch)) < 1e-10
    assert matched.residual < 1e-8
    # for a GLM the matching re-expresses the old sites exactly: nothing is left for the offset
    assert matched.record["linearisation_error"] < 1e-12
    assert matched.record["memory"] == 200


@pytest.mark.parametrize("family", ["isotropic", "full"])
def test_a_glm_memory_equals_the_true_loss_correction_of_the_same_examples(x64, family):
    (X1, y1), (X2, y2) = _task(seed=5)
    post = pc.fit(logistic_model, X1, y1, family=family, tol=TOL).keep_memory(30, selection="residual")
    memory = np.asarray(post.data_ids)
    matched = post.update(X2, y2, correction="kprior", tol=TOL)
    replayed = post.update(X2, y2, correction="memory", memory=memory, tol=TOL)
    assert float(matched.kl(replayed)) < 1e-10
    # and it is not the trivial answer: VCL (no correction) is far from both
    assert float(post.update(X2, y2, correction="none", tol=TOL).kl(replayed)) > 1e-4


def test_a_larger_memory_moves_a_logistic_update_monotonically_to_the_batch_fit(x64):
    (X1, y1), (X2, y2) = _task(seed=7)
    fitted = pc.fit(logistic_model, X1, y1, family="diagonal", tol=TOL)
    batch = pc.fit(logistic_model, jnp.concatenate([X1, X2]), jnp.concatenate([y1, y2]), family="diagonal", tol=TOL)
    # nested memories: the top examples by residual
    kls = [float(fitted.keep_memory(size, selection="residual").update(X2, y2, correction="kprior", tol=TOL).kl(batch))
           for size in (0, 10, 40, 120)]
    assert all(a > b for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] < 1e-10 and kls[0] > 1e-4


def test_the_linear_regression_correction_is_prediction_matching(x64):
    """Eq. ``corr_linreg``: ``ℓ_i − ℓ̂_{i|t} = ½‖x_iᵀm_t − x_iᵀz‖²/σ² + const`` for the isotropic family,
    and the label-free loss is that mismatch itself."""
    X, y = make_linear(40, 3, seed=2)
    post = pc.fit(linear_model, X, y, family="isotropic", tol=TOL)
    spec, data, mean = post.spec, post.data, post.state.mean
    matching = replace(spec, matching=True)
    rows = with_matching(data, predictions(spec, data, mean), jnp.ones(40))
    rng = np.random.default_rng(0)
    points = mean + jnp.asarray(rng.normal(size=(5, 3)))
    noise = 0.5
    for i in (0, 17, 39):
        row = tuple(x[i] for x in rows.per_example)
        plain = tuple(x[i] for x in data.per_example)
        kappa = jnp.stack([example_loss(matching, z, row, data.shared) for z in points])
        mismatch = 0.5 * ((X[i] @ (points - mean).T) / noise) ** 2
        np.testing.assert_allclose(kappa, mismatch, rtol=0, atol=1e-12)
        # ℓ_i − ŝ_i (the isotropic site is linear: zᵀĝ_i) differs from κ_i by a constant
        grad = post.sites.grad[i]
        gap = jnp.stack([example_loss(spec, z, plain, data.shared) - z @ grad for z in points]) - kappa
        np.testing.assert_allclose(gap - gap[0], 0.0, atol=1e-10)


def test_the_memory_is_matched_without_its_labels(x64):
    (X1, y1), (X2, y2) = _task(seed=11)
    post = pc.fit(logistic_model, X1, y1, family="full", tol=TOL).keep_memory(25, seed=1)
    X_mem, y_mem = post.data.per_example
    relabelled = post.evolve(data=post.data._replace(per_example=(X_mem, 1.0 - y_mem)))
    a = post.update(X2, y2, correction="kprior", tol=TOL)
    b = relabelled.update(X2, y2, correction="kprior", tol=TOL)
    np.testing.assert_allclose(a.state.mean, b.state.mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.state.precision, b.state.precision, rtol=0, atol=1e-10)


def test_memory_per_batch_is_chosen_by_residual_and_stays_bounded_across_tasks(x64):
    X, y = make_logistic(400, 4, seed=13)
    post = pc.fit(logistic_model, X[:100], y[:100], family="diagonal").keep_memory(20, selection="residual")
    assert post.num_retained == 20
    for start in (100, 200, 300):
        post = post.update(X[start:start + 100], y[start:start + 100], correction="kprior", memory=20,
                           selection="residual")
        assert post.record["memory"] == post.num_retained
    assert post.num_retained == 80 and post.num_examples == 400
    # the last batch's 20 are its largest site gradients at the updated posterior
    last = np.arange(300, 400)
    norms = np.linalg.norm(np.asarray(post.sites.take(np.searchsorted(np.asarray(post.sites.ids), last)).grad), axis=1)
    top = np.sort(last[np.argsort(-norms)[:20]])
    np.testing.assert_array_equal(np.asarray(post.data_ids)[-20:], top)
    # the memory's stored predictions are the model's logits at the mean
    memory = post.memory
    X_mem = memory.data.per_example[0]
    names = post.spec.latent.unravel(post.state.mean)
    np.testing.assert_allclose(memory.predictions[:, 0], X_mem @ names["w"] + names["b"], atol=1e-10)


def test_a_kprior_update_survives_save_and_load(x64, tmp_path):
    (X1, y1), (X2, y2) = _task(seed=17)
    post = pc.fit(logistic_model, X1, y1, family="full").keep_memory(15, seed=2)
    post = post.update(X2, y2, correction="kprior", memory=10)
    path = tmp_path / "kprior.npc"
    post.save(path)
    loaded = pc.load(path, logistic_model)
    np.testing.assert_array_equal(np.asarray(loaded.data_ids), np.asarray(post.data_ids))
    np.testing.assert_allclose(loaded.state.mean, post.state.mean, rtol=0, atol=0)
    assert loaded.site_identity_residual < 1e-8


@pytest.mark.parametrize("pair", [  # built inside the test, under float64
    lambda: (dist.Bernoulli(logits=0.3), dist.Bernoulli(logits=-1.1)),
    lambda: (dist.Categorical(logits=jnp.array([0.2, -0.5, 1.0])), dist.Categorical(logits=jnp.array([1.0, 0.0, -0.3]))),
    lambda: (dist.Poisson(2.5), dist.Poisson(0.7)),
    lambda: (dist.Normal(0.4, 1.3), dist.Normal(-0.2, 0.6)),
], ids=["bernoulli", "categorical", "poisson", "normal"])
def test_prediction_kl_matches_the_definition(x64, pair):
    old, new = pair()
    if isinstance(old, dist.Poisson):
        support = jnp.arange(200.0)
    elif isinstance(old, dist.Normal):
        support = jnp.linspace(-15, 15, 200001)
    else:
        support = old.enumerate_support(expand=False)
    log_old, log_new = old.log_prob(support), new.log_prob(support)
    integrand = jnp.exp(log_old) * (log_old - log_new)
    expected = jnp.trapezoid(integrand, support) if isinstance(old, dist.Normal) else jnp.sum(integrand, axis=0)
    np.testing.assert_allclose(prediction_kl(old, new), expected, rtol=1e-8)
    # through the wrappers a plate and a mask put around a site
    masked = prediction_kl(old.expand([3]).mask(jnp.array([True, False, True])),
                           new.expand([3]).mask(jnp.array([True, False, True])))
    np.testing.assert_allclose(masked, [expected, 0.0, expected], rtol=1e-8)


@pytest.mark.slow  # 6 s (measured alone, one core)
def test_prediction_kl_stays_finite_and_traceable_at_the_edges(x64):
    """A Poisson whose old rate underflowed to 0 (KL = b, the new rate) and a binomial whose total count is
    per-row data (traced, so its support cannot be enumerated): closed forms, finite, under ``jit``."""
    np.testing.assert_allclose(prediction_kl(dist.Poisson(0.0), dist.Poisson(0.7)), 0.7, rtol=1e-12)

    @jax.jit
    def binomial(n, a, b):
        return prediction_kl(dist.Binomial(n, logits=a), dist.Binomial(n, logits=b))

    p, q = jax.nn.sigmoid(0.3), jax.nn.sigmoid(-1.0)
    expected = 5.0 * (p * jnp.log(p / q) + (1 - p) * jnp.log((1 - p) / (1 - q)))
    np.testing.assert_allclose(binomial(5.0, 0.3, -1.0), expected, rtol=1e-12)


def test_refusals_say_why():
    (X1, y1), (X2, y2) = _task(seed=19)
    post = pc.fit(logistic_model, X1, y1, family="diagonal")
    with pytest.raises(InvalidOptionError, match="join the function-space memory"):
        post.update(X2, y2, correction="kprior", memory=[0, 1])
    with pytest.raises(InvalidOptionError, match="chooses a memory of a given size"):
        post.update(X2, y2, correction="kprior", selection="residual")
    with pytest.raises(errors.MissingCapabilityError, match="gradients only"):  # before any solve
        pc.fit(logistic_model, X1, y1, family="isotropic").update(X2, y2, correction="kprior", memory=5,
                                                                    selection="leverage")

    def student(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.StudentT(4.0, X @ w, 1.0), obs=y)

    robust = pc.fit(student, X1, y1, family="diagonal")
    with pytest.raises(UnsupportedModelError, match="StudentT"):
        robust.update(X2, y2, correction="kprior")
    y = jnp.asarray(np.random.default_rng(0).uniform(size=30) < 0.3, jnp.float32)
    ef = pc.dual_form(beta_bernoulli, beta_guide, {"a": jnp.array(1.0), "b": jnp.array(1.0)}, y)
    with pytest.raises(InvalidOptionError, match="kprior"):
        ef.update(y[:5], correction="kprior")


@pytest.mark.slow  # 4 s (measured alone, one core)
def test_a_network_update_drops_exactly_the_linearisation_error(x64):
    """A one-hidden-layer tanh network (eq. ``pred_match_general``): at the K-prior's fixed point ``m*`` the
    gradient of the exact objective (new + past true losses + prior) is the dropped linearisation term,
    ``Σ_i r_{i|t} (∇f_i(m*) − ∇f_i(m_t))``, with ``r_{i|t} = σ(f_i(m_t)) − y_i`` — nothing else."""
    def mlp(X, y=None):
        W1 = numpyro.sample("W1", dist.Normal(0.0, 1.0).expand([X.shape[1], 4]).to_event(2))
        w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=jnp.tanh(X @ W1) @ w2), obs=y)

    X, y = make_logistic(400, 3, seed=23)
    post = pc.fit(mlp, X[:300], y[:300], family="full", expectation="delta", curvature="ggn", tol=1e-10)
    matched = post.update(X[300:380], y[300:380], correction="kprior", tol=1e-10)
    unravel = post.spec.latent.unravel

    def logits(z, Xs):
        v = unravel(z)
        return jnp.tanh(Xs @ v["W1"]) @ v["w2"]

    def objective(z):  # prior N(0, 1) on every weight; Bernoulli likelihood of all 380 examples
        f = logits(z, X[:380])
        return 0.5 * z @ z - jnp.sum(y[:380] * f - jax.nn.softplus(f))

    m_t, m_star = post.state.mean, matched.state.mean
    residual = jax.nn.sigmoid(logits(m_t, X[:300])) - y[:300]
    dropped = (jax.jacobian(logits)(m_star, X[:300]) - jax.jacobian(logits)(m_t, X[:300])).T @ residual
    gradient = jax.grad(objective)(m_star)
    assert float(jnp.linalg.norm(dropped)) > 1e-2  # the network is not linear here: the term is not trivially 0
    # the solver's relative residual is 1e-10 of Σ_i ‖∇ℓ_i‖ (about 10² here): 1e-8 of the term's norm bounds it
    np.testing.assert_allclose(gradient, dropped, atol=1e-8 * float(jnp.linalg.norm(dropped)) + 1e-9)
    assert 1e-8 < matched.record["linearisation_error"] < 1.0
    assert matched.site_identity_residual < 1e-8
