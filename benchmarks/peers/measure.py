"""Time and peak resident memory of a computation, for benchmark workers (standard library only,
Linux; shared by the torch workers and the neural-tangents driver, which run in different venvs).

Each measurement runs in a fresh process. `PeakRSS` reports the peak resident set size during
the block minus the resident size just before it: a thread samples /proc/self/statm every
millisecond, and the kernel's own high-water mark (getrusage ru_maxrss) is used as well whenever
the block raised it, since then it is exact.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.increase`: peak RSS during the block minus RSS before."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.increase = 0

    def __enter__(self) -> PeakRSS:
        self._stop = threading.Event()
        self._before = rss_bytes()
        self._maxrss_before = _maxrss_bytes()
        self._peak = self._before
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_bytes())
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        peak = max(self._peak, rss_bytes())
        maxrss = _maxrss_bytes()
        if maxrss > self._maxrss_before:  # the block set a new high-water mark: exact
            peak = max(peak, maxrss)
        self.increase = peak - self._before


def timed(fn: Callable[[], Any], repeats: int, slow: float) -> tuple[Any, list[float], int]:
    """Call `fn` up to `repeats` times: (first result, wall times, peak RSS increase of the first
    call). A first call slower than `slow` seconds is not repeated."""
    with PeakRSS() as memory:
        start = time.perf_counter()
        result = fn()
        times = [time.perf_counter() - start]
    while len(times) < repeats and times[0] <= slow:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return result, times, memory.increase
