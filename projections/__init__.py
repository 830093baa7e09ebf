"""Random projections of per-sample Jacobians: projected features and kernels (unbiased
estimates of the eNTK), and resumable on-disk feature stores for kernels larger than memory."""

from ._projectors import DEFAULT_PROJECTOR, PROJECTORS
from .projected import Featurizer, features, kernel, projected_ntk
from .store import StoreError, featurize, open_store, store_info

__all__ = [
    "DEFAULT_PROJECTOR",
    "PROJECTORS",
    "Featurizer",
    "StoreError",
    "featurize",
    "features",
    "kernel",
    "open_store",
    "projected_ntk",
    "store_info",
]
