"""The binding's structural analyses are memoised by what decides them (numpyro_pc.model.analysis_memo).

Oracles: a second binding of the same model equals the first and runs the model fewer times (the
jaxpr analyses are not redone); a fixed argument whose value changes what depends on the latents
gets its own analysis (a memo keyed by shapes alone would hand it the other's); a binding that does
not hash is analysed every time.
"""

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import numpyro_pc as pc
from numpyro_pc.model import analysis_memo

CALLS = {"n": 0}


def counted(X, y=None):
    CALLS["n"] += 1
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def switched(X, y=None, flag=True):
    """With ``flag`` set the noise scale is a latent (its leaf depends on z); without it, fixed."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    scale = s if flag else 1.0
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, scale), obs=y)


def _data(n=30, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    return jnp.asarray(X), jnp.asarray(X @ rng.normal(size=d) + rng.normal(size=n))


def test_a_second_binding_reuses_the_structural_analyses():
    analysis_memo.clear()
    X, y = _data()
    CALLS["n"] = 0
    first, _ = pc.bind_model(counted, (X, y))
    cold = CALLS["n"]
    CALLS["n"] = 0
    again, _ = pc.bind_model(counted, (X[:20], y[:20] + 1.0))  # other values and size: the same structure
    assert again.param_leaves == first.param_leaves and again.support_sites == first.support_sites
    memo_calls = CALLS["n"]
    assert memo_calls < cold, (memo_calls, cold)
    analysis_memo.clear()
    CALLS["n"] = 0
    pc.bind_model(counted, (X[:20], y[:20] + 1.0))
    assert CALLS["n"] > memo_calls  # the control: with the memo cleared the analyses run again (jit caches warm)


def test_a_fixed_argument_that_changes_the_structure_gets_its_own_analysis():
    analysis_memo.clear()
    X, y = _data(seed=1)
    on, _ = pc.bind_model(switched, (X, y), {"flag": True})
    off, _ = pc.bind_model(switched, (X, y), {"flag": False})
    assert on.param_leaves != off.param_leaves  # the scale leaf depends on z only when the flag is set
    assert pc.bind_model(switched, (X, y), {"flag": True})[0].param_leaves == on.param_leaves


def test_a_binding_that_does_not_hash_is_analysed_every_time():
    X, y = _data(seed=2)
    spec, data = pc.bind_model(counted, (X, y))
    unhashable = replace(spec, statics=({2.0},))  # a set: what jit could not take as a static argument either
    assert analysis_memo.structural_key(unhashable, data) is None
    runs = []
    for _ in range(2):
        analysis_memo.memoised("supports", None, lambda: runs.append(1))
    assert len(runs) == 2
