"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI.

The public names are imported on first use (PEP 562), so that `attribution.cli` can print its
help without importing torch."""

import importlib

_PUBLIC = {
    "KernelSurrogate": ".surrogate",
    "NTKPosterior": ".posterior",
    "calibration_metrics": ".evaluation",
    "expected_calibration_error": ".evaluation",
    "flip_labels": ".evaluation",
    "influence": "._influence",
    "layer_importance": ".layers",
    "lds": ".evaluation",
    "mislabel_auc": ".evaluation",
    "random_subsets": ".evaluation",
    "reliability": ".evaluation",
    "report": "._report",
    "sample_interactions": ".interactions",
    "train_on_subsets": ".evaluation",
    "trak": "._trak",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
