"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI."""
from .layers import layer_importance  # noqa: F401
