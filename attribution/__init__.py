"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI."""

from ._influence import influence
from ._posterior import NTKPosterior
from ._report import report
from ._trak import trak
from .evaluation import flip_labels, lds, mislabel_auc, random_subsets, train_on_subsets
from .layers import layer_importance
from .surrogate import KernelSurrogate

__all__ = [
    "KernelSurrogate",
    "NTKPosterior",
    "flip_labels",
    "influence",
    "layer_importance",
    "lds",
    "mislabel_auc",
    "random_subsets",
    "report",
    "train_on_subsets",
    "trak",
]
