"""Per-sample functions of a model: `torch.func.vmap` over samples where the model allows it,
one sample at a time where it does not.

vmap cannot run code that branches on tensor values, such as the attention-mask handling of
HuggingFace transformers (`if (mask == 1).all(): ...`). The first vmapped call that fails for a
model where the loop over its samples runs (the same values, one forward and backward pass per
sample) marks the model and warns once with the reason; every later call for that model loops.
A failure of the loop too is the model's own (a sample it cannot take): it is raised, and the
model stays unmarked.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.func import vmap

from . import inputs
from .memory import out_of_memory
from .model import ModelView

BATCHING_NOTE = "There is a performance drop"  # how torch's notes on a missing vmap rule begin


class PerSampleFallbackWarning(UserWarning):
    """The model could not be vmapped over samples; samples are processed one at a time."""


_NOT_VMAPPABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason


def vmappable(model) -> bool:
    """False once `map_samples` has found that `model` cannot be vmapped over samples."""
    return model not in _NOT_VMAPPABLE


def map_samples(view: ModelView, fn: Callable, params, x, *per_sample) -> object:
    """fn(params, x_b, *(a[b] for a in per_sample)) for every sample b of `x` (without its sample
    axis), stacked along a new first axis (tensors, or dicts/tuples of tensors)."""
    if view.model in _NOT_VMAPPABLE:
        return _loop(fn, params, x, per_sample)
    try:
        return vmap(fn, in_dims=(None, 0) + (0,) * len(per_sample))(params, x, *per_sample)
    except Exception as error:
        if out_of_memory(error):
            raise
        rows = _loop(fn, params, x, per_sample)  # fails too where the model itself fails
        fall_back(
            _NOT_VMAPPABLE,
            view.model,
            error,
            "{model} cannot be vmapped over samples ({reason}); computing per-sample "
            "derivatives one sample at a time",
        )
        return rows


def _loop(fn: Callable, params, x, per_sample: tuple) -> object:
    """`map_samples` one sample at a time."""
    with quiet_batching_notes():  # vmap over cotangents inside fn
        rows = [
            fn(params, inputs.take(x, b), *(a[b] for a in per_sample))
            for b in range(inputs.count(x))
        ]
    return _stack(rows)


def fall_back(registry: weakref.WeakKeyDictionary, model, error: Exception, says: str) -> None:
    """Record in `registry` that `model` takes a fallback from now on, with `error`'s reason
    (`failure_reason`), and say so once: a PerSampleFallbackWarning from `says` with {model}
    (its class name) and {reason} filled in, attributed to the caller of the function that
    fell back."""
    reason = failure_reason(error)
    registry[model] = reason
    warnings.warn(
        says.format(model=type(model).__name__, reason=reason),
        PerSampleFallbackWarning,
        stacklevel=3,
    )


def failure_reason(error: Exception) -> str:
    """The first line of `error`'s message (its type where it has none), at most 120
    characters: the reason a fallback warning gives."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return reason if len(reason) <= 120 else reason[:119] + "…"


@contextmanager
def quiet_batching_notes() -> Iterator[None]:
    """Silence torch's notes that an op has no vmap batching rule (it is only slower: e.g. the
    backward of fused CPU attention under batched gradients)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=BATCHING_NOTE)
        yield


def _stack(rows: list):
    first = rows[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(rows)
    if isinstance(first, dict):
        return {k: _stack([r[k] for r in rows]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_stack(list(parts)) for parts in zip(*rows))
    raise TypeError(f"per-sample results must be tensors, dicts or tuples, got {type(first)}")
