"""One rogue client against bounded aggregation (issue 28 item 2; :mod:`numpyro_pc.federated.robust`).

Honest clients (IID shards of a synthetic logistic regression and of breast cancer) run FedPC through the
server logic of the Flower transport (no network) until their sites settle; then

* **one aggregation**: a rogue's message is added to the settled honest sites and aggregated with
  ``max_share = γ``, ``max_shift = c``; reported: the global mean's distance to the honest posterior
  ``m_H`` in honest-posterior sds ``‖m − m_H‖_{P_H}`` (bounded and unbounded), the largest eigenvalue of
  ``P_H^{-1} P``, whether the rogue and whether any honest client was clipped. Messages: linear part
  ``1e3, 1e6, 1e11`` (every coordinate) × precision ``1e-6 … 1e9 · I``, a replay of client 0's site, the
  same ×1e3, and for each honest client ``i`` a near-replay of all honest data but ``i``'s (precision
  ``γ P_{H\\i}``, pull ``c`` sds towards ``m_{H\\i}``: the rogue the stated bound's extra term is for);
* **a run**: the rogue registers honestly, then sends the same message every round for ``--rounds``
  rounds while the honest clients answer the poisoned global posterior; reported: the final mean's
  distance to the honest run's, in its sds (not covered by the guarantee: the honest sites of a
  non-conjugate model move with the posterior they are computed at), the largest distance in any round to
  the posterior of that round's honest sites (what the guarantee bounds), and the honest clients clipped.

The stated bound (module docstring of ``robust``): ``c (1 + 2γ) / (1 + γ)`` when every honest client is within
the bounds against the other honest clients (the column ``honest within`` says whether they are).

    PYTHONPATH=. python benchmarks/bench_federated_rogue.py [--shift 2] [--share 1] [--rounds 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, quiet, write_results  # noqa: E402
from numpyro_pc.datasets.loaders import load_breast_cancer  # noqa: E402
from numpyro_pc.families.registry import GaussianNatural  # noqa: E402
from numpyro_pc.federated.logic import ClientLogic  # noqa: E402
from numpyro_pc.federated.robust import aggregate_sites  # noqa: E402
from numpyro_pc.federated.server import ServerLogic  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_out")
HONEST = 5


def model(X, y=None):
    """Logistic regression with an intercept, prior N(0, 1) on every coefficient."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def datasets():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4))
    y = (rng.uniform(size=400) < 1 / (1 + np.exp(-(X @ rng.normal(size=4) + 0.3)))).astype(float)
    yield "synthetic (400 × 4)", X, y
    X, y, _ = load_breast_cancer()
    yield "breast cancer (569 × 30)", np.asarray(X, float), np.asarray(y, float)


def shards(X, y, k, seed=0):
    order = np.random.default_rng(seed).permutation(len(y))
    return [(jnp.asarray(X[i]), jnp.asarray(y[i])) for i in np.array_split(order, k)]


def one_round(server, clients, extra=None):
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    replies = {f"node{k}": c.update(arrays, server.config)[0] for k, c in enumerate(clients)}
    replies.update(extra or {})
    return quiet(server.aggregate, replies)


def dense(p):
    p = np.asarray(p)
    return p if p.ndim == 2 else np.diag(p)


def posterior(prior, lin, prec):
    P = dense(prior.precision) + sum(dense(p) for p in prec)
    return P, np.linalg.solve(P, np.asarray(prior.linear) + sum(np.asarray(h) for h in lin))


def sds(P_H, m_H, m):
    return float(np.sqrt((m - m_H) @ P_H @ (m - m_H)))


def messages(family, sites, prior, share, shift):
    d = sites.linear.shape[1]
    fmt = (lambda m: m) if family == "full" else np.diag  # noqa: E731
    out = [(f"linear {lin:g}, precision {p:g}·I", np.full(d, lin), fmt(p * np.eye(d)))
           for lin in (1e3, 1e6, 1e11) for p in (1e-6, 1e-3, 1.0, 1e3, 1e6, 1e9)]
    out.append(("replay of client 0", np.asarray(sites.linear[0]), np.asarray(sites.precision[0])))
    out.append(("replay of client 0 ×1e3", 1e3 * np.asarray(sites.linear[0]), 1e3 * np.asarray(sites.precision[0])))
    P_H, m_H = posterior(prior, sites.linear, sites.precision)
    for i in range(HONEST):
        keep = np.array([j for j in range(HONEST) if j != i])
        P_i, m_i = posterior(prior, sites.linear[keep], sites.precision[keep])
        u = P_i @ (m_i - m_H)
        u *= (1 - 1e-9) * shift / np.sqrt(u @ np.linalg.solve(P_i, u))
        S = (1 - 1e-9) * share * (P_i if family == "full" else np.diag(P_i))
        out.append((f"near-replay of all but client {i}", dense(S) @ m_i + u, S))
    return out


def honest_margins(sites, prior):
    """Each honest client's share ``λ_max(P_{H\\i}^{-1} S_i)`` and shift ``‖g_i‖_{P_{H\\i}^{-1}}`` (the premise)."""
    top, pull = [], []
    for i in range(HONEST):
        keep = np.array([j for j in range(HONEST) if j != i])
        P_i, m_i = posterior(prior, sites.linear[keep], sites.precision[keep])
        S = dense(sites.precision[i])
        g = np.asarray(sites.linear[i]) - S @ m_i
        top.append(float(scipy.linalg.eigh(S, P_i, eigvals_only=True).max()))
        pull.append(float(np.sqrt(g @ np.linalg.solve(P_i, g))))
    return max(top), max(pull)


def study(name, X, y, family, share, shift, rounds):
    parts = shards(X, y, HONEST)
    clients = [ClientLogic(model, p) for p in parts]
    server = ServerLogic(HONEST, "fedpc", family, rho=0.5, x64=True)
    quiet(server.aggregate_initial, {f"node{k}": c.initial(server.config) for k, c in enumerate(clients)})
    for _ in range(8):
        one_round(server, clients)
    ids = sorted(server.sites)
    sites = GaussianNatural(jnp.stack([server.sites[k].linear for k in ids]),
                            jnp.stack([server.sites[k].precision for k in ids]))
    prior, fam = server.prior_nat, server.family
    P_H, m_H = posterior(prior, sites.linear, sites.precision)
    top, pull = honest_margins(sites, prior)
    within = top <= share and pull <= shift
    bounds = (jnp.asarray(share), jnp.asarray(shift))
    alone = np.asarray(aggregate_sites(fam, prior, sites, bounds)[1])  # honest clients clipped without a rogue
    rows = []
    for label, h, S in messages(family, sites, prior, share, shift):
        eta = jax.tree.map(lambda a, b: jnp.concatenate([a, jnp.asarray(b)[None]]), sites, GaussianNatural(h, S))
        out = {}
        for key, b in (("unbounded", None), ("bounded", bounds)):
            total, clipped = aggregate_sites(fam, prior, eta, b)
            P = dense(prior.precision) + dense(total.precision)
            out[key] = sds(P_H, m_H, np.linalg.solve(P, np.asarray(prior.linear + total.linear)))
            if b is not None:
                out["top"] = float(scipy.linalg.eigh(P, P_H, eigvals_only=True).max())
                out["rogue_clipped"], out["honest_clipped"] = bool(clipped[-1]), int(np.sum(clipped[:-1]))
                out["clipped_by_rogue"] = int(np.sum(np.asarray(clipped[:-1]) & ~alone))
        rows.append(dict(message=label, **out))
    runs = []
    for label, h, S in [r for r in messages(family, sites, prior, share, shift)
                        if r[0] in ("linear 1e+11, precision 1·I", "linear 1000, precision 1e-06·I")]:
        runs.append(poisoned_run(parts, family, share, shift, rounds, label, h, S))
    pull_site = (np.full(len(m_H), 5e10), 1e9 * (np.eye(len(m_H)) if family == "full" else np.ones(len(m_H))))
    runs.append(poisoned_run(parts, family, share, shift, rounds, "pull to 50, precision 1e9·I", *pull_site))
    return dict(data=name, family=family, honest_top=top, honest_pull=pull, honest_within=within,
                honest_clipped_alone=int(alone.sum()), rows=rows, runs=runs)


def poisoned_run(parts, family, share, shift, rounds, label, h, S):
    """The rogue registers honestly (client 0's site at half weight), then sends ``(h, S)`` every round."""
    runs = {}
    for bounded in (False, True):
        clients = [ClientLogic(model, p) for p in parts]
        kw = dict(max_share=share, max_shift=shift) if bounded else {}
        server = ServerLogic(HONEST + 1, "fedpc", family, rho=0.5, x64=True, **kw)
        init = {f"node{k}": c.initial(server.config) for k, c in enumerate(clients)}
        rogue = [0.5 * init["node0"][0], 0.5 * init["node0"][1], *init["node0"][2:]]
        quiet(server.aggregate_initial, dict(init, rogue=rogue))
        honest_clipped, per_round = 0, 0.0
        for _ in range(rounds):
            one_round(server, clients, {"rogue": [h, S] * 2})
            honest_clipped += sum(c != "rogue" for c in server.history[-1]["clipped_clients"])
            # the guarantee's own terms: this round's mean against the posterior of this round's honest sites
            kept = [v for k, v in sorted(server.sites.items()) if k != "rogue"]
            P_r, m_r = posterior(server.prior_nat, [v.linear for v in kept], [v.precision for v in kept])
            per_round = max(per_round, sds(P_r, m_r, np.asarray(server.state.mean)))
        runs[bounded] = (server, honest_clipped, per_round)
    clients = [ClientLogic(model, p) for p in parts]
    honest = ServerLogic(HONEST, "fedpc", family, rho=0.5, x64=True)
    quiet(honest.aggregate_initial, {f"node{k}": c.initial(honest.config) for k, c in enumerate(clients)})
    for _ in range(rounds):
        one_round(honest, clients)
    P_H, m_H = dense(honest.state.precision), np.asarray(honest.state.mean)
    dist_ = {b: sds(P_H, m_H, np.asarray(s.state.mean)) for b, (s, _, _) in runs.items()}
    return dict(message=label, unbounded=dist_[False], bounded=dist_[True], honest_clipped_rounds=runs[True][1],
                per_round=runs[True][2])


def render(res, share, shift):
    bound = shift * (1 + 2 * share) / (1 + share)
    lines = [f"γ = {share:g}, c = {shift:g}: stated bound c(1 + 2γ)/(1 + γ) = {bound:g} honest-posterior sds "
             f"({HONEST} honest clients + 1 rogue).", ""]
    for r in res:
        lines += [f"### {r['data']}, {r['family']} family", "",
                  f"honest clients against each other: largest share {r['honest_top']:.3f}, largest shift "
                  f"{r['honest_pull']:.3f} sds → premise {'holds' if r['honest_within'] else 'fails'}; honest "
                  f"clients clipped without a rogue: {r['honest_clipped_alone']}", "",
                  "| rogue message | unbounded shift (sds) | bounded shift (sds) | λ_max(P_H⁻¹P) | rogue clipped "
                  "| honest clipped (of them not clipped without the rogue) |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['message']} | {x['unbounded']:.3g} | {x['bounded']:.3f} | {x['top']:.3f} | "
                  f"{'yes' if x['rogue_clipped'] else 'no'} | {x['honest_clipped']} ({x['clipped_by_rogue']}) |"
                  for x in r["rows"]]
        lines += ["", "| run: rogue every round | unbounded: final mean (sds of the honest run) | bounded: final "
                  "mean | bounded: largest round's shift from that round's honest sites | honest clipped "
                  "(client-rounds) |", "|---|---|---|---|---|"]
        lines += [f"| {x['message']} | {x['unbounded']:.3g} | {x['bounded']:.3f} | {x['per_round']:.3f} | "
                  f"{x['honest_clipped_rounds']} |" for x in r["runs"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=1.0)
    parser.add_argument("--shift", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--families", default="full,diagonal")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    start, res = time.time(), []
    for name, X, y in datasets():
        for family in args.families.split(","):
            res.append(study(name, X, y, family, args.share, args.shift, args.rounds))
            print(f"{name} {family}: {time.time() - start:.0f} s", flush=True)
    bound = args.shift * (1 + 2 * args.share) / (1 + args.share)
    held = [r for r in res if r["honest_within"]]
    targets = [dict(target=f"bounded shift ≤ {bound:g} sds where the premise holds",
                    measured=f"max {max((x['bounded'] for r in held for x in r['rows']), default=float('nan')):.3f}",
                    met=all(x["bounded"] <= bound * (1 + 1e-9) for r in held for x in r["rows"])),
               dict(target="no honest client clipped because of the rogue where the premise holds",
                    measured=f"{sum(x['honest_clipped'] for r in held for x in r['rows'])} clipped",
                    met=all(x["honest_clipped"] == 0 for r in held for x in r["rows"]))]
    result = dict(share=args.share, shift=args.shift, rounds=args.rounds, studies=res, seconds=time.time() - start,
                  machine=machine_info())
    write_results(f"federated_rogue_g{args.share:g}_c{args.shift:g}", args.out, result, render(res, args.share, args.shift), targets)


if __name__ == "__main__":
    main()
