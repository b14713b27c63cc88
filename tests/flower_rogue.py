"""A misbehaving Flower client for the process tests: ``nan`` sends NaN sites, ``crash-*`` dies, ``big`` (a site
whose linear part is 1e11) and ``pull`` (precision 1e9·I pulling the mean to 50) register honestly and then send
sites that pass the server's checks (finite, below ``max_abs``, PSD)."""

import os
import sys

import numpy as np

from numpyro_pc.federated import flower, logic


class Rogue(flower.ClientLogic):
    """Honest until told otherwise by ``mode``."""

    mode = "nan"

    def initial(self, config):
        if self.mode == "crash-init":
            os._exit(3)
        arrays = super().initial(config)
        return [np.full_like(a, np.nan) for a in arrays] if self.mode == "nan" else arrays

    def update(self, arrays, config):
        if self.mode == "crash-update":
            os._exit(3)
        out, metrics = super().update(arrays, config)
        if self.mode == "big":
            return [np.full_like(out[0], 1e11), *out[1:]], metrics
        if self.mode == "pull":
            dim = out[0].shape[0]
            return [np.full(dim, 5e10), 1e9 * np.eye(dim)] * (len(out) // 2), metrics
        return [np.full_like(a, np.nan) for a in out], metrics


if __name__ == "__main__":
    Rogue.mode = sys.argv.pop(1)
    logic.ClientLogic = Rogue  # what ClientByFamily makes for a Gaussian run
    sys.exit(flower.main(["client", *sys.argv[1:]]))
