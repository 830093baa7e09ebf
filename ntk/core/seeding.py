"""Seeded draws that leave the caller's random streams where they were."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def seeded(seed: int, module: nn.Module | None = None) -> Iterator[None]:
    """The global random state seeded with `seed` inside and restored afterwards: the CPU's and
    the CUDA devices' the draws may use, those holding `module`'s parameters and buffers, or,
    with module=None (a factory whose module is not built yet), every visible CUDA device
    (torch.manual_seed seeds them all, so forking the CPU's state alone moved the GPUs')."""
    if module is None:
        gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    else:
        tensors = itertools.chain(module.parameters(), module.buffers())
        gpus = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=gpus):
        torch.random.default_generator.manual_seed(seed)
        for gpu in gpus:
            with torch.cuda.device(gpu):
                torch.cuda.manual_seed(seed)
        yield
