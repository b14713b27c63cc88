"""``python -m numpyro_pc demo``: the sections in order, on the breast-cancer data."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp

import numpyro_pc as pc
from numpyro_pc.datasets.loaders import load_breast_cancer
from numpyro_pc.demos import SECTIONS
from numpyro_pc.demos.models import logistic_model
from numpyro_pc.errors import InvalidOptionError

__all__ = ["SECTIONS", "demo"]


# Each section's module is imported in its branch below, when the section runs: the sections need extras
# (arviz, scikit-learn, optax, GPJax) that the others and the command line's parser do not.
def demo(out="demo_output", fast=False, svi_steps=None, seed=0, sections=None) -> dict:
    """The package on scikit-learn's breast-cancer data, in sections (:data:`SECTIONS`):

    1. ``dual_form``: SVI → ``dual_form`` → ``refine``; prints the residual before and after,
       the KL between the SVI guide and the refined posterior and the time of each step;
       writes ``dual_form.png``.
    2. ``trust`` (right or refused): a regression on scikit-learn's *unscaled* diabetes data with a
       weakly-informative ``HalfNormal(100)`` noise prior fitted from the default start, and
       a model whose plate size is not tied to the data refused with a typed error.
    3. ``hierarchical``: a centred hierarchy fitted from the ELBO start and updated exactly.
    4. ``streaming``: the data in 5 drifting batches with every correction policy, then a group
       deletion with every method and a change of the prior with each correction; prints tables of KL
       and time; writes ``streaming.png``.
    5. ``criticism``: all-N leave-one-out from the sites, ``az.compare`` against a smaller
       model, exact refits of the flagged examples; writes ``criticism.png``.
    6. ``merging_federated``: two half-data posteriors merged with every method; 10 non-IID
       clients reaching the joint posterior; writes ``merging_federated.png``.
    7. ``expfam``: a regression with a full Gaussian weight block and a Gamma noise precision
       on the unscaled diabetes data, streamed and pruned, checked against closed-form
       coordinate ascent; writes ``expfam.png``.
    8. ``streaming_gp`` (``gp`` extra): a 1-D stream in 4 batches with learned
       hyperparameters and inducing inputs; writes ``streaming_gp.png``.

    :param sections: names from :data:`SECTIONS` to run (default: all, in that order). Without
        ``dual_form`` the sections that need a fitted posterior use one ``pc.fit``.
    :return: a dict of the measured numbers of the sections that ran.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = SECTIONS if sections is None else tuple(sections)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown demo section(s) {unknown}; expected some of {list(SECTIONS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    with jax.enable_x64(True):
        X, y, names = load_breast_cancer()
        X, y = jnp.asarray(X), jnp.asarray(y)
        print(f"breast-cancer data: N={X.shape[0]} examples, {X.shape[1]} features (+ intercept), float64")
        post = scratch = None
        if "dual_form" in chosen:
            from numpyro_pc.demos.dual_form import demo_dual_form

            result.update(demo_dual_form(X, y, names, out, plt, fast, svi_steps, seed))
            post, scratch = result.pop("_post"), result.pop("_scratch")
        elif {"criticism", "merging_federated"} & set(chosen):
            t0 = time.perf_counter()
            scratch = post = pc.fit(logistic_model, X, y, family="full")
            result["timings"] = dict(fit=time.perf_counter() - t0)
        if "trust" in chosen:
            from numpyro_pc.demos.trust import demo_trust

            result["trust"] = demo_trust()
        if "hierarchical" in chosen:
            from numpyro_pc.demos.hierarchical import demo_hierarchical

            result["hierarchical"] = demo_hierarchical()
        if "streaming" in chosen:
            from numpyro_pc.demos.streaming import demo_streaming

            result["streaming"] = demo_streaming(X, y, out, plt, fast)
        if "criticism" in chosen:
            from numpyro_pc.demos.criticism import demo_criticism

            result["criticism"] = demo_criticism(post, X, y, out, plt, result["timings"]["fit"])
        if "merging_federated" in chosen:
            from numpyro_pc.demos.federated import demo_merging_federated

            result["merging_federated"] = demo_merging_federated(logistic_model, X, y, out, plt, fast, joint=scratch)
        if "expfam" in chosen:
            from numpyro_pc.demos.expfam import demo_expfam

            result["expfam"] = demo_expfam(out, plt, fast)
        if "streaming_gp" in chosen:
            try:  # the streaming-GP section needs the optional ``gp`` extra (GPJax)
                from numpyro_pc.demos.gp import demo_streaming_gp
            except ImportError:
                result["streaming_gp"] = None
                print("\nstreaming sparse GP section skipped (install the 'gp' extra for GPJax)")
            else:
                result["streaming_gp"] = demo_streaming_gp(out, plt, fast, seed)
    return result
