"""Kernel-machine surrogates, data attribution, layer importance, reports and the `ntk` CLI."""
from .layers import layer_importance  # noqa: F401
from .report import report  # noqa: F401
from .evaluation import flip_labels, lds, mislabel_auc, random_subsets, train_on_subsets  # noqa: F401
from .influence import influence  # noqa: F401
from .surrogate import KernelSurrogate  # noqa: F401
from .trak import trak  # noqa: F401
