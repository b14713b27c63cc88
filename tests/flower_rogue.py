"""A misbehaving Flower client for the process tests: ``nan`` sends NaN sites, ``crash-*`` dies."""

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
        return [np.full_like(a, np.nan) for a in out], metrics


if __name__ == "__main__":
    Rogue.mode = sys.argv.pop(1)
    logic.ClientLogic = Rogue  # what ClientByFamily makes for a Gaussian run
    sys.exit(flower.main(["client", *sys.argv[1:]]))
