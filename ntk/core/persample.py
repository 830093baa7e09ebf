"""Per-sample functions of a model: `torch.func.vmap` over samples where the model allows it,
one sample at a time where it does not.

vmap cannot run code that branches on tensor values, such as the attention-mask handling of
HuggingFace transformers (`if (mask == 1).all(): ...`). The first vmapped call that fails for a
model marks the model, warns once with the reason, and this and every later call for that model
loop over the samples instead (the same values, one forward and backward pass per sample).

Some of torch's batching rules are wrong without failing: per-sample Jacobians (jacrev, a vmap
over cotangents inside the vmap over samples) through `prelu` (nn.PReLU) come out wrong when
there are as many samples as cotangents (torch 2.13), and the kernel would be silently wrong.
Every vmapped call is therefore checked on its last sample, run alone; a mismatch marks the
model as one that fails.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.func import vmap

from . import inputs
from .model import ModelView


class PerSampleFallbackWarning(UserWarning):
    """The model could not be vmapped over samples; samples are processed one at a time."""


_NOT_VMAPPABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason


def vmappable(model) -> bool:
    """False once `map_samples` has found that `model` cannot be vmapped over samples."""
    return model not in _NOT_VMAPPABLE


def map_samples(view: ModelView, fn: Callable, params, x, *per_sample) -> object:
    """fn(params, x_b, *(a[b] for a in per_sample)) for every sample b of `x` (without its sample
    axis), stacked along a new first axis (tensors, or dicts/tuples of tensors)."""
    n = inputs.count(x)

    def alone(b: int):
        with quiet_batching_notes():  # vmap over cotangents inside fn
            return fn(params, inputs.take(x, b), *(a[b] for a in per_sample))

    if view.model not in _NOT_VMAPPABLE:
        reason = None
        try:
            result = vmap(fn, in_dims=(None, 0) + (0,) * len(per_sample))(params, x, *per_sample)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # any failure under vmap: the loop shows a real error again
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            reason = reason if len(reason) <= 120 else reason[:119] + "…"
        else:
            if n < 2 or _agree(_row(result, n - 1), alone(n - 1)):
                return result
            reason = (
                "its vmapped derivatives differ from one sample's run alone, a batching rule "
                "torch gets wrong, as of prelu"
            )
        _NOT_VMAPPABLE[view.model] = reason
        warnings.warn(
            f"{type(view.model).__name__} cannot be vmapped over samples ({reason}); "
            "computing per-sample derivatives one sample at a time",
            PerSampleFallbackWarning,
            stacklevel=2,
        )
    return _stack([alone(b) for b in range(n)])


def _row(result, b: int):
    """Sample b's part of a stacked result (tensors, or dicts/tuples of tensors)."""
    if isinstance(result, torch.Tensor):
        return result[b]
    if isinstance(result, dict):
        return {k: _row(v, b) for k, v in result.items()}
    return type(result)(_row(v, b) for v in result)


def _agree(batched, single) -> bool:
    """Whether two per-sample results (same structure) are equal to float rounding."""
    if isinstance(batched, torch.Tensor):
        if batched.shape != single.shape:
            return False
        if not single.is_floating_point() or not single.numel():
            return torch.equal(batched, single)
        tol = max(1e-4, 10 * torch.finfo(single.dtype).eps)  # half precision rounds more
        scale = float(single.abs().max())
        return torch.allclose(batched, single, rtol=tol, atol=0.1 * tol * scale)
    if isinstance(batched, dict):
        return all(_agree(batched[k], single[k]) for k in batched)
    return all(_agree(a, b) for a, b in zip(batched, single))


@contextmanager
def quiet_batching_notes() -> Iterator[None]:
    """Silence torch's notes that an op has no vmap batching rule (it is only slower: e.g. the
    backward of fused CPU attention under batched gradients)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
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
