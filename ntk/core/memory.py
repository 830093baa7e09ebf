"""Memory available for a computation, and block sizes that keep it bounded."""

from __future__ import annotations

import math
import os

import torch


class KernelTooLargeError(MemoryError):
    """The requested kernel cannot be held in memory at all."""


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure: torch.OutOfMemoryError (CUDA), or the plain
    RuntimeError of torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory" / "not
    enough memory"). Fallbacks for what a model cannot do (vmap, torch.func, forward mode) must
    not take it for one: it says nothing about the model, and passes on to the caller."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def block_size(n: int, per_sample: float, per_pair: float, budget: float) -> int:
    """Largest b ≤ n with 2·b·per_sample + b²·per_pair ≤ budget (at least 1)."""
    if per_pair <= 0:
        b = budget / max(2 * per_sample, 1.0)
    else:
        b = (-2 * per_sample + math.sqrt(4 * per_sample**2 + 4 * per_pair * budget)) / (
            2 * per_pair
        )
    return int(max(1, min(n, b)))


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
