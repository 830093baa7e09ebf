"""Empirical neural tangent kernels of PyTorch models."""

import importlib

from .core.kinds import KINDS, LABELLED_KINDS
from .core.memory import KernelTooLargeError
from .empirical import METHODS, empirical_ntk, empirical_ntk_fn
from .spectrum import condition_number, descent_residual, eigenvalues, kernel_alignment

__all__ = [
    "KINDS",
    "LABELLED_KINDS",
    "METHODS",
    "KernelTooLargeError",
    "condition_number",
    "descent_residual",
    "eigenvalues",
    "empirical_ntk",
    "empirical_ntk_fn",
    "kernel_alignment",
    "proxies",
]


def __getattr__(name: str):
    """`ntk.proxies` is imported on first use: it needs scipy.stats, which `import ntk` alone
    does not (see benchmarks/core_timings.py)."""
    if name == "proxies":
        return importlib.import_module(f"{__name__}.proxies")
    raise AttributeError(f"module 'ntk' has no attribute {name!r}")
