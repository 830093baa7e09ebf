"""Empirical neural tangent kernels of PyTorch models."""

from . import proxies
from .core.kinds import KINDS, LABELLED_KINDS
from .core.memory import KernelTooLargeError
from .empirical import METHODS, empirical_ntk, empirical_ntk_fn
from .spectrum import condition_number, eigenvalues, kernel_alignment

__all__ = [
    "KINDS",
    "LABELLED_KINDS",
    "METHODS",
    "KernelTooLargeError",
    "condition_number",
    "eigenvalues",
    "empirical_ntk",
    "empirical_ntk_fn",
    "kernel_alignment",
    "proxies",
]
