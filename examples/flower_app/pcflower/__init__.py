"""The model and the data of the example Flower app (see ``pyproject.toml``)."""
