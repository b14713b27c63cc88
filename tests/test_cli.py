"""The demo runs end to end on the embedded dataset and reports a converged dual form."""

import numpy as np

from numpyro_pc.cli import demo


def test_demo_fast(tmp_path, capsys):
    result = demo(out=tmp_path, fast=True, svi_steps=300)
    assert result["residual_before"] > 1e-3 > 1e-8 > result["residual_after"]
    assert abs(result["kl_fit"]) < 1e-8  # pc.fit without SVI reaches the same fixed point
    assert (tmp_path / "dual_form.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "KL(SVI guide" in printed and "residual" in printed
    stream = {label: kl for label, kl, _ in result["streaming"]["stream"]}
    assert stream["exact"] < 1e-8 < stream["none"]  # exact streaming recovers the batch posterior
    assert stream["stochastic"] < 1e-6
    # a policy that fell back is marked in the table and explained under it, with the batches it happened at
    marked = sorted(label.split()[0] for label in stream if label.endswith("*"))
    assert marked == sorted(result["streaming"]["fallbacks"])
    assert all(f"* {name}: at batch(es)" in printed for name in marked)
    deletion = {method: kl for method, kl, _ in result["streaming"]["delete"]}
    assert deletion["corrected"] < 1e-8 and deletion["remove_site"] < deletion["tracin"]
    assert (tmp_path / "streaming.png").stat().st_size > 10_000
    merged = dict(result["merging_federated"]["merge"])
    assert merged["bayesian"] < merged["task_arithmetic"]
    fed = {name: (kl, status) for name, _, kl, _, status in result["merging_federated"]["federated"]}
    # FedPC with its default ρ and with the floor ρ = 0.5 that diverged here before the safeguard
    assert all(fed[name][0] < 1e-8 and fed[name][1] == "converged" for name in ("fedpc", "fedpc ρ=0.5", "pvi"))
    assert not [line for line in printed.splitlines() if line.startswith("fedpc") and "diverged" in line]
    assert result["trust"]["residual"] < 1e-8 and "plate 'data' keeps size" in result["trust"]["refused"]
    hierarchical = result["hierarchical"]  # a centred hierarchy from the ELBO start, updated exactly
    assert hierarchical["start"] == "elbo" and hierarchical["residual"] < 1e-8 and hierarchical["update_kl"] < 1e-8
    assert (tmp_path / "merging_federated.png").stat().st_size > 10_000
    assert (tmp_path / "streaming_gp.png").stat().st_size > 10_000  # streaming sparse GP section
    criticism = result["criticism"]  # all-N LOO: finite, the richer model preferred, refits of the flagged ones
    assert np.isfinite(criticism["elpd_loo"]) and criticism["best"] == "30 features"
    assert np.isfinite(criticism["refitted_elpd"]) and (tmp_path / "criticism.png").stat().st_size > 10_000


def test_the_package_version_is_the_installed_distribution_version():
    from importlib import metadata

    import numpyro_pc

    assert numpyro_pc.__version__ == metadata.version("numpyro-pc")
