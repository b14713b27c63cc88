"""posteriordb real-model suite: ``pc.fit`` with defaults against long-run NUTS references.

For each supported posterior, ``pc.fit`` with its defaults must converge (no error,
residual ≤ tol) and, for every unconstrained coordinate whose reference marginal is close
to Gaussian (|skewness| < 0.5 and |excess kurtosis| < 1 of the 1,000 unconstrained
reference draws, :func:`numpyro_pc.posteriordb.reference.compare`), match the reference mean within
0.1 reference sd and the sd within 20 %. Unsupported posteriors must raise their typed error.

Of the eight nes data sets (same model, same structure) two are fitted here; the benchmark
``benchmarks/bench_posteriordb.py`` runs all of them.
"""

import warnings

import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.posteriordb import reference as pdb
from numpyro_pc.errors import MonteCarloErrorWarning

pytestmark = pytest.mark.skipif(pdb.posteriordb_dir() is None,
                                reason="posteriordb data folder not found (set NUMPYRO_PC_DATA or provide "
                                       "../shared/data/posteriordb)")

# Monte Carlo posteriors (per-example dependence subspace of more than three dimensions): the default
# 64 fixed, moment-matched draws leave an error that pc.fit reports with MonteCarloErrorWarning.
# low_dim_gauss_mix (d = 5) matches the reference with them (mu mean within 0.06 ref sd; it was
# 0.27 with i.i.d. draws); gp_pois_regr does not:
_MC_FAIL = {
    "gp_pois_regr-gp_pois_regr":
        "default 64 MC draws: alpha mean off by 0.18 ref sd (0.62 with i.i.d. draws), sd of rho/alpha/f_tilde[1] "
        "0.42x the reference (MonteCarloErrorWarning, independent-draws residual 8e-3); the sds stay 0.41-0.44x "
        "with num_samples=2048: the Gaussian VB optimum itself is too narrow",
}
_SKIP_NES = {f"nes{y}-nes" for y in (1976, 1980, 1984, 1988, 1992, 1996)}
_SLOW = {"diamonds-diamonds"}


def _params():
    out = []
    for name in pdb.SUPPORTED:
        if name in _SKIP_NES:
            continue
        marks = [pytest.mark.slow] if name in _SLOW else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_fit_matches_reference(name, x64):
    posterior = pdb.load_posterior(name)
    tr = pdb.translate(name, posterior=posterior)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = pc.fit(tr.model, *tr.args, **tr.kwargs)
    assert float(post.residual) <= 1e-8
    mc_warned = any(issubclass(w.category, MonteCarloErrorWarning) for w in caught)
    res = pdb.compare(post.mean, post.covariance, tr, posterior, post.latent)
    g = res["gaussian"]
    assert g.any()
    bad_mean = res["labels"][g & (np.abs(res["z"]) > 0.1)]
    bad_sd = res["labels"][g & (np.abs(res["sd_ratio"] - 1.0) > 0.2)]
    if name in _MC_FAIL:
        assert mc_warned, "a Monte Carlo fit this far off must warn"
        if bad_mean.size or bad_sd.size:
            pytest.xfail(_MC_FAIL[name])
        pytest.fail(f"{name} now matches the reference: remove it from _MC_FAIL")
    assert not bad_mean.size, f"means off by > 0.1 ref sd: {bad_mean}, z={res['z']}"
    assert not bad_sd.size, f"sds off by > 20 %: {bad_sd}, ratio={res['sd_ratio']}"


@pytest.mark.parametrize("name", list(pdb.UNSUPPORTED))
def test_unsupported_raise_typed_error(name, x64):
    _, expected, _ = pdb.UNSUPPORTED[name]
    with pytest.raises(expected) as err:
        tr = pdb.translate(name)
        pc.fit(tr.model, *tr.args, **tr.kwargs)
    assert type(err.value) is expected


@pytest.mark.parametrize("name", list(pdb.NOT_TRANSLATED))
def test_not_translated_refused(name):
    with pytest.raises(pc.UnsupportedModelError, match="reference|Markov"):
        pdb.translate(name)


def test_loader_and_names():
    posterior = pdb.load_posterior("kidiq-kidscore_momhs")
    assert posterior.data["kid_score"].shape == (434,)
    assert set(posterior.summary) == {"beta[1]", "beta[2]", "sigma"}
    assert posterior.draws["sigma"].shape == (1000,)
    tr = pdb.translate("kidiq-kidscore_momhs", posterior=posterior)
    assert tr.params == {"beta": ["beta[1]", "beta[2]"], "sigma": ["sigma"]}
    with pytest.raises(pc.UnsupportedModelError):
        pdb.translate("no-such-posterior")


def test_the_reference_posterior_type_was_renamed_with_an_alias():
    # pc.Posterior is the fitted posterior of every family; the posteriordb entry is a ReferencePosterior
    with pytest.warns(FutureWarning, match="ReferencePosterior"):
        assert pdb.Posterior is pdb.ReferencePosterior
    assert pdb.ReferencePosterior is not pc.Posterior
    with pytest.raises(AttributeError):
        pdb.NoSuchName  # noqa: B018
