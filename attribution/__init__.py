"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI."""
from .evaluation import flip_labels, lds, mislabel_auc, random_subsets, train_on_subsets
from ._influence import influence
from .layers import layer_importance
from ._report import report
from .surrogate import KernelSurrogate
from ._trak import trak

__all__ = ["KernelSurrogate", "flip_labels", "influence", "layer_importance", "lds",
           "mislabel_auc", "random_subsets", "report", "train_on_subsets", "trak"]
