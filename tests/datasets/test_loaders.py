"""Dataset loaders read the shared data (checksummed) and refuse altered files."""

import numpy as np
import pytest

from numpyro_pc.datasets import loaders as datasets

SHARED = datasets.data_dir()
needs_data = pytest.mark.skipif(SHARED is None or not (SHARED / "a7a").is_dir(),
                                reason="../shared/data (or NUMPYRO_PC_DATA) is not present on this machine")


def test_breast_cancer_is_embedded():
    X, y, names = datasets.load_breast_cancer()
    assert X.shape == (569, 30) and set(np.unique(y)) == {0.0, 1.0} and len(names) == 30
    np.testing.assert_allclose(X.mean(0), 0.0, atol=1e-12)


@needs_data
def test_shared_datasets_load_with_expected_shapes():
    X, y = datasets.load_a7a("train")
    assert X.shape == (16100, 123) and set(np.unique(y)) == {0.0, 1.0}
    assert datasets.load_a7a("test")[0].shape == (16461, 123)
    assert datasets.load_uci("power-plant")[0].shape == (9568, 4)
    assert datasets.load_uci("concrete")[0].shape == (1030, 8)
    assert datasets.load_bui2017_toy()[0].shape == (150, 1)
    assert datasets.load_banana("test")[0].shape == (4900, 2)
    assert datasets.load_snelson()[0].shape == (200, 1)


@needs_data
def test_altered_file_is_refused(tmp_path):
    target = tmp_path / "bui2017"
    target.mkdir()
    original = (SHARED / "bui2017" / "reg_toy_x.txt").read_text().splitlines()
    (target / "reg_toy_x.txt").write_text("\n".join(original[:-1]) + "\n")  # truncated copy
    (target / "reg_toy_y.txt").write_text((SHARED / "bui2017" / "reg_toy_y.txt").read_text())
    with pytest.raises(datasets.DatasetError, match="truncated or altered"):
        datasets.load_bui2017_toy(path=tmp_path)


def test_missing_data_says_where_it_looked(tmp_path):
    with pytest.raises(datasets.DatasetError, match="NUMPYRO_PC_DATA"):
        datasets.load_uci("concrete", path=tmp_path)
