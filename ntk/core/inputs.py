"""Sample-structured model inputs: a tensor, a tuple of tensors (positional arguments) or a
dict of tensors (keyword arguments), each with the sample axis first."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from .checks import check_finite

Inputs = torch.Tensor | tuple | list | dict


def _leaves(x: Inputs) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return list(x)
    if isinstance(x, dict):
        return list(x.values())
    raise TypeError(
        f"inputs must be a tensor, a tuple of tensors or a dict of tensors, got {type(x).__name__}"
    )


def param_dtype(model) -> torch.dtype | None:
    """The dtype of `model`'s first floating parameter (None: it has none), the one numpy arrays
    of floats are cast to (numpy's default float64 to a float32 model: as sklearn casts; the
    model is not changed). A torch tensor keeps its dtype."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def from_numpy(x, name: str, dtype: torch.dtype | None = None):
    """`x` with numpy arrays (alone, in a tuple/list or in a dict) turned into tensors of the
    same dtype (floating ones in `dtype` when given), so that arrays are accepted wherever
    tensors are; tensors pass through. A list of no tensors or arrays (numbers, rows of them) is
    read as a numpy array, as scikit-learn reads it; a tuple stays several model inputs."""

    def one(leaf):
        if not isinstance(leaf, np.ndarray):
            return leaf
        if leaf.dtype.kind not in "biufc":
            raise TypeError(f"{name} holds a numpy array of dtype {leaf.dtype}, not numbers")
        t = torch.as_tensor(np.ascontiguousarray(leaf))
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    if isinstance(x, list) and not any(isinstance(v, (torch.Tensor, np.ndarray)) for v in x):
        try:
            x = np.asarray(x)
        except ValueError:
            raise ValueError(
                f"{name} is a list that is not an array of numbers (rows of unequal length?): "
                "pass a tensor or numpy array (a tuple means several model inputs)"
            ) from None
    if isinstance(x, (tuple, list)):
        return tuple(one(v) for v in x)
    if isinstance(x, dict):
        return {k: one(v) for k, v in x.items()}
    return one(x)


def targets(y, name: str = "y") -> torch.Tensor:
    """Labels or targets (a tensor, numpy array or list) as a tensor, detached (targets taken from
    a model's output carry its graph); anything that is not numbers or booleans (strings,
    objects) refused with a message naming `name`."""
    if isinstance(y, torch.Tensor):
        return y.detach()
    array = numbers(
        y, name, " (integer class labels or real targets)", "; map class names to 0..C−1 first"
    )
    return torch.as_tensor(array)


def numbers(x, name: str, what: str = "", advice: str = "") -> np.ndarray:
    """`x` (a numpy array or a list) as a numpy array of numbers or booleans; strings and objects
    are refused naming `name` (`what` describes the numbers wanted, `advice` ends the message)."""
    array = np.asarray(x)
    if array.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold numbers{what}, got {array.dtype.name} values such as "
            f"{array.reshape(-1)[:1].tolist()}{advice}"
        )
    return array


def check_finite_targets(y: torch.Tensor, name: str = "y") -> None:
    """Real-valued targets [N, ...] must be finite: refused naming the first sample that is not."""
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        i = int((~torch.isfinite(y)).reshape(len(y), -1).any(1).nonzero()[0])
        raise ValueError(f"{name} contains non-finite values (NaN or inf), first at sample {i}")


def validate(x: Inputs, name: str) -> int:
    """Check structure, a shared sample axis and finiteness; return the number of samples."""
    leaves = _leaves(x)
    if not leaves:
        raise ValueError(f"{name} holds no tensors")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name} must hold tensors only, got {type(leaf).__name__}")
        if leaf.dim() == 0:
            raise ValueError(f"{name} holds a 0-d tensor; the first axis must index samples")
    n = leaves[0].shape[0]
    if any(leaf.shape[0] != n for leaf in leaves):
        raise ValueError(
            f"{name}: all tensors must have the same number of samples (first axis), got "
            f"{[leaf.shape[0] for leaf in leaves]}"
        )
    if n == 0:
        raise ValueError(f"{name} holds no samples")
    for leaf in leaves:
        if leaf.is_floating_point() or leaf.is_complex():
            check_finite(leaf, name)
    return n


def signature(x: Inputs) -> Any:
    """Per-sample structure and shapes, used to check that x1 and x2 are compatible."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape[1:])
    if isinstance(x, dict):
        return {k: tuple(v.shape[1:]) for k, v in x.items()}
    return tuple(tuple(v.shape[1:]) for v in x)


def check_structure(x1: Inputs, x2: Inputs, names: tuple[str, str] = ("x1", "x2")) -> None:
    """Refuse inputs of another structure (a tensor and a dict, dicts of other keys, tuples of
    other lengths); per-sample shapes may differ (sequences of other lengths), the model decides
    whether it takes them. `names` name them in errors."""
    first, second = names
    if type(x1) is not type(x2) and not (
        isinstance(x1, (tuple, list)) and isinstance(x2, (tuple, list))
    ):
        raise ValueError(
            f"{first} and {second} must have the same structure, got {type(x1).__name__} and "
            f"{type(x2).__name__}"
        )
    if isinstance(x1, dict) and set(x1) != set(x2):
        raise ValueError(
            f"{first} and {second} must have the same keys, got {sorted(x1)} and {sorted(x2)}"
        )
    if isinstance(x1, (tuple, list)) and len(x1) != len(x2):
        raise ValueError(
            f"{first} and {second} must hold as many tensors, got {len(x1)} and {len(x2)}"
        )


def check_compatible(x1: Inputs, x2: Inputs, names: tuple[str, str] = ("x1", "x2")) -> None:
    """Refuse inputs of another structure or per-sample shapes (where they are joined into one
    batch); `names` name them in errors."""
    check_structure(x1, x2, names)
    s1, s2 = signature(x1), signature(x2)
    first, second = names
    if s1 != s2:
        raise ValueError(f"{first} and {second} have different per-sample shapes: {s1} vs {s2}")


def count(x: Inputs) -> int:
    return _leaves(x)[0].shape[0]


def take(x: Inputs, index: slice | torch.Tensor) -> Inputs:
    """Select samples (a slice or an index tensor) from every tensor."""
    if isinstance(x, torch.Tensor):
        return x[index]
    if isinstance(x, dict):
        return {k: v[index] for k, v in x.items()}
    return tuple(v[index] for v in x)


def cat(x1: Inputs, x2: Inputs, names: tuple[str, str] = ("x1", "x2")) -> Inputs:
    """The samples of x1 followed by those of x2 (same structure, checked under `names`; x2 moved
    to x1's devices; dicts joined by key, whatever their order)."""
    check_compatible(x1, x2, names)
    if isinstance(x1, dict):
        return {k: torch.cat([a, x2[k].to(a.device)]) for k, a in x1.items()}
    joined = [torch.cat([a, b.to(a.device)]) for a, b in zip(_leaves(x1), _leaves(x2))]
    return joined[0] if isinstance(x1, torch.Tensor) else tuple(joined)


def convert(x: Inputs, device: torch.device, dtype: torch.dtype | None) -> Inputs:
    """Move to `device`; cast floating tensors to `dtype` (integer tensors such as token ids
    stay). Inputs are constants of every derivative taken here: detached from any graph (an
    input with requires_grad left the kernels and outputs attached to it)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.detach().to(device=device, dtype=dtype)
        return t.detach().to(device=device)

    if isinstance(x, torch.Tensor):
        return one(x)
    if isinstance(x, dict):
        return {k: one(v) for k, v in x.items()}
    return tuple(one(v) for v in x)


def clone(x: Inputs) -> Inputs:
    """A detached copy of every tensor: the inputs an estimator keeps (its training set) do not
    change when the caller changes the arrays or tensors it passed in place afterwards."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: v.detach().clone() for k, v in x.items()}
    return tuple(v.detach().clone() for v in x)


def as_call(x: Inputs) -> tuple[tuple, dict]:
    """Positional and keyword arguments for `model(*args, **kwargs)`."""
    if isinstance(x, torch.Tensor):
        return (x,), {}
    if isinstance(x, dict):
        return (), dict(x)
    return tuple(x), {}


def unsqueeze(x: Inputs) -> Inputs:
    """Add a sample axis of length one (used inside vmap, where samples arrive one at a time)."""
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0)
    if isinstance(x, dict):
        return {k: v.unsqueeze(0) for k, v in x.items()}
    return tuple(v.unsqueeze(0) for v in x)


def hash_tensor(h, name: str, t: torch.Tensor) -> None:
    """Feed a tensor's name, dtype, shape and bytes into the hashlib object `h`."""
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def digest(x: Inputs) -> str:
    """SHA-256 of samples: the names (positions or dict keys, sorted), dtypes, shapes and bytes
    of their tensors."""
    h = hashlib.sha256()
    if isinstance(x, dict):
        named = sorted(x.items())
    else:
        named = [(str(i), t) for i, t in enumerate(_leaves(x))]
    for name, t in named:
        hash_tensor(h, name, t)
    return h.hexdigest()
