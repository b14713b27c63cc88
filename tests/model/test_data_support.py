"""Data outside the model's support is refused on every path that takes data (issue 32, item 1).

Oracles: the distribution's own support decides; an accepted array-like must give exactly
the posterior of the same data as NumPy arrays (bit for bit: the same numbers go in).
"""

import io as _io
import json
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numpyro_pc as pc
from numpyro_pc import errors, federated
from numpyro_pc.io import archive
from numpyro_pc.model import data_support
from numpyro_pc.io import save_load as io
from numpyro_pc.model import likelihood

from models import logistic_model, make_logistic


def poisson_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)


def uniform_bound_model(y=None):
    """Observations Uniform(0, θ): the support depends on the latent, so it is the likelihood's to judge."""
    theta = numpyro.sample("theta", dist.LogNormal(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Uniform(0.0, theta), obs=y)


def masked_bernoulli(X, y, observed):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w).mask(observed), obs=y)


def beta_bernoulli(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(p), obs=y)


@pytest.fixture(scope="module")
def logistic():
    with jax.enable_x64(True):
        X, y = make_logistic(120, 2, seed=3)
        yield X, y, pc.fit(logistic_model, X, y)


def test_a_label_outside_the_support_in_any_row_is_refused_by_fit(x64):
    X, y = make_logistic(200, 2, seed=1)
    y = np.asarray(y).copy()
    y[100] = 50.0  # the case: row 100, beyond the rows any probe of the first few would see
    with pytest.raises(errors.DataSupportError) as info:
        pc.fit(logistic_model, X, y)
    text = str(info.value)
    for part in ("'y'", "argument 'y'", "row 100: 50.0", "1 of 200", "Boolean"):
        assert part in text, (part, text)


@pytest.mark.parametrize("correction", ["exact", "none", "memory", "stochastic", "prior"])
@pytest.mark.parametrize("label", [2.0, -1.0])
def test_every_correction_refuses_labels_outside_the_support(logistic, x64, correction, label):
    X, y, post = logistic
    bad = np.asarray(y[:5]).copy()
    bad[3] = label
    with pytest.raises(errors.DataSupportError, match=r"the new batch.*row 3: " + str(label)):
        post.update(X[:5], bad, correction=correction)


@pytest.mark.parametrize("count, correction", [(2.5, "stochastic"), (-1.0, "stochastic"), (-1.0, "exact")])
def test_poisson_counts_outside_the_support_are_refused_with_the_label_named(x64, count, correction):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(60, 2))
    y = rng.poisson(1.0, 60).astype(float)
    post = pc.fit(poisson_model, X, y)
    bad = y[:4].copy()
    bad[1] = count
    with pytest.raises(errors.DataSupportError) as info:
        post.update(X[:4], bad, correction=correction)
    text = str(info.value)  # the message names the label, not priors or scaling
    assert f"row 1: {count}" in text and "Poisson" in text and "IntegerNonnegative" in text
    assert "prior" not in text


def test_one_label_broadcast_to_every_row_is_refused(x64):
    X, _ = make_logistic(50, 2, seed=2)
    with pytest.raises(errors.DataShapeError, match=r"value of shape \(\).*broadcast to every row"):
        pc.fit(logistic_model, X, np.array(1.0))


def test_pandas_data_gives_the_posterior_of_the_same_numbers(logistic, x64):
    X, y, post = logistic
    frame = pd.DataFrame(np.asarray(X), columns=["a", "b"])
    from_pandas = pc.fit(logistic_model, frame, pd.Series(np.asarray(y)))
    np.testing.assert_array_equal(np.asarray(from_pandas.mean), np.asarray(post.mean))
    updated = post.update(frame.iloc[:10], pd.Series(np.asarray(y)[:10]), correction="exact")
    reference = post.update(np.asarray(X)[:10], np.asarray(y)[:10], correction="exact")
    np.testing.assert_array_equal(np.asarray(updated.mean), np.asarray(reference.mean))


def test_an_object_array_of_numbers_is_accepted_as_those_numbers(logistic, x64):
    X, y, post = logistic
    as_objects = np.asarray(y, dtype=float).astype(object)
    np.testing.assert_array_equal(np.asarray(pc.fit(logistic_model, X, as_objects).mean), np.asarray(post.mean))


def test_text_and_mixed_columns_are_refused_by_type(x64):
    X, y = make_logistic(20, 2, seed=4)
    with pytest.raises(errors.DataTypeError, match=r"argument 'y' .*dtype <U"):
        pc.fit(logistic_model, X, np.array(["yes", "no"] * 10))
    mixed = pd.DataFrame({"a": np.asarray(X)[:, 0], "b": ["x"] * 20})
    with pytest.raises(errors.DataTypeError, match=r"argument 'X' \(DataFrame\) has dtypes"):
        pc.fit(logistic_model, mixed, y)


def test_a_support_that_depends_on_the_latents_is_left_to_the_likelihood(x64):
    y = np.random.default_rng(0).uniform(0.0, 0.1, 40)
    spec, _ = likelihood.bind_model(uniform_bound_model, (y,))
    assert spec.support_sites == ()  # Uniform(0, θ): no fixed point of z can decide it
    spec, _ = likelihood.bind_model(logistic_model, make_logistic(10, 2, seed=0))
    assert spec.support_sites == ("y",)


def test_masked_out_rows_are_not_checked(x64):
    X, y = make_logistic(40, 2, seed=6)
    y = np.asarray(y).copy()
    observed = np.ones(40, bool)
    y[7], observed[7] = 9.0, False
    post = pc.fit(masked_bernoulli, X, y, observed)
    observed[7] = True
    with pytest.raises(errors.DataSupportError, match="row 7: 9.0"):
        pc.fit(masked_bernoulli, X, y, observed)
    assert np.isfinite(np.asarray(post.mean)).all()


def masked_rows_to_event(X, Y, M):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w).mask(M).to_event(1), obs=Y)


def zeros_trick(X):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("z", dist.Normal(X @ w, 1.0), obs=0.0)


def test_masks_under_to_event_are_respected(x64):
    """Missing entries of a multi-output row filled with −1 and masked (a mask inside ``to_event``)."""
    rng = np.random.default_rng(0)
    X, Y, M = rng.normal(size=(60, 2)), (rng.random((60, 3)) < 0.5).astype(float), rng.random((60, 3)) < 0.7
    filled = np.where(M, Y, -1.0)
    spec, _ = likelihood.bind_model(masked_rows_to_event, (X, filled, M))
    assert spec.support_sites == ("y",)
    M[5, 0], filled[5, 0] = True, 3.0  # an observed entry outside {0, 1}
    with pytest.raises(errors.DataSupportError, match=r"row 5: \[3.0"):
        likelihood.bind_model(masked_rows_to_event, (X, filled, M))


def test_a_constant_written_in_the_model_is_not_a_broadcast_argument(x64):
    """The zeros trick: obs=0.0 in every row is the model's own constant, not a label passed once."""
    X, _ = make_logistic(30, 2, seed=3)
    spec, _ = likelihood.bind_model(zeros_trick, (X,))
    assert spec.observed == ("z",)


def test_batches_of_one_bucket_share_one_program(logistic, x64):
    """65 and 100 rows both pad to 128: the second batch compiles nothing new."""
    X, y, post = logistic
    rows = np.arange(100) % 120
    post.update(X[rows[:65]], y[rows[:65]], correction="none")
    before = data_support._support_rows._cache_size()
    post.update(X[rows], y[rows], correction="none")
    assert data_support._support_rows._cache_size() == before


def test_an_exponential_family_posterior_refuses_them_too(x64):
    y = (np.random.default_rng(1).random(30) < 0.3).astype(float)
    post = pc.fit(beta_bernoulli, y, family={"p": "beta"})
    with pytest.raises(errors.DataSupportError, match="row 0: 2.0"):
        post.update(np.array([2.0, 1.0]), correction="exact")


def test_a_federated_client_with_labels_outside_the_support_is_refused(x64):
    X, y = make_logistic(60, 2, seed=8)
    y = np.asarray(y).copy()
    y[45] = 3.0
    clients = [(X[:30], y[:30]), (X[30:], y[30:])]
    with pytest.raises(errors.DataSupportError, match="client 1's shard: .*row 15: 3.0"):
        federated.run(logistic_model, clients, rounds=2)


def test_labels_edited_in_a_saved_file_are_refused_on_load(logistic, x64, tmp_path):
    X, y, post = logistic
    path = tmp_path / "post.npz"
    post.save(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["manifest.json"])
    name = next(n for n in manifest["arrays"] if n.startswith("data.example.") and
                np.load(_io.BytesIO(members[f"{n}.npy"])).ndim == 1)
    labels = np.load(_io.BytesIO(members[f"{name}.npy"])).copy()
    labels[4] = 7.0
    members[f"{name}.npy"] = archive.npy_bytes(labels)
    manifest["arrays"][name] = {"sha256": io.digest(labels), "dtype": str(labels.dtype), "shape": list(labels.shape)}
    members["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(path, "w") as z:
        for member, blob in members.items():
            z.writestr(member, blob)
    with pytest.raises(errors.InconsistentFileError, match=r"row 4: 7.0.*altered"):
        pc.load(path, logistic_model)


def test_the_check_reuses_its_program_across_batch_sizes(logistic, x64):
    X, y, post = logistic
    for n in (3, 17, 40):  # every size below the smallest bucket shares one program
        post.update(X[:n], y[:n], correction="none")
    before = data_support._support_rows._cache_size()
    post.update(X[:33], y[:33], correction="none")
    assert data_support._support_rows._cache_size() == before


_BAD_VALUES = st.sampled_from([np.nan, np.inf, -1.0, 0.5, 2.0, 1e300])


@given(rows=st.integers(0, 4), value=_BAD_VALUES, where=st.sampled_from(["X", "y"]),
       kind=st.sampled_from(["array", "list", "scalar", "text", "3d"]))
def test_bad_data_raises_only_package_errors(logistic, x64, rows, value, where, kind):
    """Whatever is wrong with a batch, what is raised is a package error (or nothing, for valid data)."""
    X, y, post = logistic
    Xb, yb = np.asarray(X)[:rows].copy(), np.asarray(y)[:rows].copy()
    if rows:
        (Xb if where == "X" else yb)[..., 0 if where == "X" else rows - 1] = value
    arg = Xb if where == "X" else yb
    if kind == "list":
        arg = arg.tolist()
    elif kind == "scalar":
        arg = np.float64(value)
    elif kind == "text":
        arg = arg.astype(str)
    elif kind == "3d":
        arg = arg[..., None, None]
    batch = (arg, yb) if where == "X" else (Xb, arg)
    try:
        post.update(*batch, correction="exact")
    except errors.PosteriorCorrectionError:
        pass
