"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI."""
