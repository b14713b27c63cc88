"""No (d, d) array on the default paths of the diagonal, isotropic and low-rank families (issue 30 item 1).

Every program JAX lowers — jitted functions and the op-by-op dispatches alike — is dumped as StableHLO
(``jax_dump_ir_to``) while ``pc.fit`` + an exact ``update`` + a corrected ``delete`` of 100 examples run
with default options in a fresh process (so that no program compiled earlier hides in a cache), and
every tensor type in the dumps is read: none may have two dimensions ``≥ d``. The control runs the
same tracer over the full family's start, whose Laplace precision is its ``(d, d)`` Hessian, and must
find it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

_TENSOR = re.compile(r"tensor<((?:\d+x)+)[a-z]+\d*>")
D, N = 3000, 200


def square_tensors(text: str, dim: int) -> set[str]:
    """The tensor shapes in StableHLO ``text`` with at least two dimensions ``≥ dim`` (``"3000x3000"``)."""
    found = set()
    for match in _TENSOR.findall(text):
        dims = [int(v) for v in match.rstrip("x").split("x")]
        if sum(v >= dim for v in dims) >= 2:
            found.add("x".join(map(str, dims)))
    return found


def _logistic(d, n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * (3.0 / np.sqrt(d))
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(float)
    return x, y


def _run(what: str, dim: int, num: int) -> dict:
    """In this (fresh) process: the path ``what`` with every lowered program dumped; the offending programs."""
    dump = tempfile.mkdtemp(prefix="pc_dd_")
    import jax

    jax.config.update("jax_dump_ir_to", dump)
    jax.config.update("jax_enable_x64", True)
    import numpy as np

    import numpyro_pc as pc
    from models import logistic_model

    x, y = _logistic(dim, num + num // 2)
    if what == "full-start":  # the control: the full family's start forms its (d, d) Hessian
        from numpyro_pc.families.registry import FullGaussian
        from numpyro_pc.model.likelihood import bind_model
        from numpyro_pc.solvers.start import default_start

        spec, data = bind_model(logistic_model, (x[:num], y[:num]))
        default_start(spec, data, FullGaussian(), None, np.float64)
    else:
        options = dict(family=what, rank=10) if what == "lowrank" else dict(family=what)
        post = pc.fit(logistic_model, x[:num], y[:num], **options)
        post = post.update(x[num:], y[num:], correction="exact")
        post = post.delete(np.arange(100), method="corrected")
        post.save(os.path.join(dump, "..", os.path.basename(dump) + ".npz"))
    bad = {}
    for name in sorted(os.listdir(dump)):
        with open(os.path.join(dump, name)) as f:
            shapes = square_tensors(f.read(), dim)
        if shapes:
            bad[name] = sorted(shapes)
    return dict(programs=len(os.listdir(dump)), square=bad)


def run_in_fresh_process(what: str, dim: int = D, num: int = N) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), root, os.environ.get("PYTHONPATH", "")]),
               NUMPYRO_PC_NO_COMPILATION_CACHE="1", JAX_COMPILATION_CACHE_DIR="")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), what, str(dim), str(num)], capture_output=True,
                          text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_square_tensors_reads_stablehlo_types():
    text = ("%1 = stablehlo.dot %a, %b : (tensor<200x3000xf64>, tensor<3000xf64>) -> tensor<200xf64>\n"
            "%2 = call @_diag(%x) : (tensor<3000xf32>) -> tensor<3000x3000xf32>\n"
            "%3 = stablehlo.iota dim = 0 : tensor<64x3000x3001xi64>\n%4 = tensor<3000x11xf64>")
    assert square_tensors(text, 3000) == {"3000x3000", "64x3000x3001"}
    assert square_tensors(text, 3002) == set()


@pytest.mark.slow  # 186 s on the 2-core machine at load 12 (a d = 3,001 Hessian and its eigh in a fresh process)
def test_control_the_full_familys_start_shows_its_dense_hessian():
    found = run_in_fresh_process("full-start")
    assert found["square"], "the tracer missed the full family's (d, d) Hessian"
    hessians = [shapes for name, shapes in found["square"].items() if "hessian" in name]
    assert hessians and f"{D + 1}x{D + 1}" in hessians[0]  # d = 3,000 weights and the intercept


@pytest.mark.slow  # 130-415 s each on the 2-core machine at load 12 (fit, exact update, corrected deletion)
@pytest.mark.parametrize("family", ["diagonal", "isotropic", "lowrank"])
def test_default_paths_form_no_square_array(family):
    found = run_in_fresh_process(family)
    assert found["programs"] > 20  # the dump saw the run
    assert found["square"] == {}


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
