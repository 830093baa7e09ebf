"""A resumable on-disk store of projected features, for kernels larger than memory.

`featurize` streams the features of a data set into a directory, block by block, and resumes an
interrupted run with the missing blocks, producing the same bytes as an uninterrupted run; the
format (features.npy, manifest.json with the digests of every block's features and inputs, and a
writer's lock) is described in `projections._format`. Stores written with other settings, another
model or other data, edited manifests, and truncated or corrupted blocks are refused with
`StoreError`; so is a second writer while one is at work.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from ntk.core import inputs, kinds
from ntk.core.checks import check_integer
from ntk.core.files import make_directory
from ntk.distributed import rank_and_world

from . import _format
from ._format import (
    StoreError,
    check_not_foreign,
    foreign_files,
    is_complete,
    open_store,
    store_info,
)
from ._projectors import DEFAULT_PROJECTOR
from .distributed import featurize_shard
from .projected import Featurizer

__all__ = [
    "StoreError",
    "check_not_foreign",
    "featurize",
    "foreign_files",
    "is_complete",
    "open_store",
    "store_info",
]


def featurize(
    model: nn.Module,
    data,
    path: str | os.PathLike,
    *,
    dim: int,
    kind: str | kinds.Kind = "trace",
    projector: str = DEFAULT_PROJECTOR,
    seed: int = 0,
    block: int = 1024,
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    store_dtype: str = "float32",
    output_fn: Callable | None = None,
    progress: bool | None = None,
    distributed: bool | None = None,
) -> np.ndarray:
    """Stream the projected features of `data` (see `projections.features`) into the store at
    `path`, `block` samples per block, resuming an interrupted run; returns `open_store(path)`.
    kind: one that takes no labels (not lpntk).

    data: a tensor or numpy array (or tuple/dict of them) with samples first, a `TensorDataset`
    (its first tensor is the model input) or a `DataLoader` with a sequential sampler (batches
    that are tuples/lists use their first element). `batch_size` samples are featurised at a
    time (None: chosen from free memory on the first run, then reused so that a resumed run
    repeats the same arithmetic). `progress`: a tqdm bar (None: only on a terminal).
    A complete store is only read (its data checked against the manifest), so it may sit in a
    read-only directory; an incomplete one is written by one process at a time.
    distributed: share the blocks among the ranks of the torch.distributed process group, every
    rank calling with the same arguments (None: whenever a group of more than one process is
    initialised); see `projections.distributed`.
    """
    root = _format.store_root(path)
    check_not_foreign(root)
    block = check_integer(block, "block")
    batch_size = check_integer(batch_size, "batch_size", optional=True)
    if isinstance(store_dtype, torch.dtype):  # torch.float16 names the same dtype as numpy's
        store_dtype = str(store_dtype).removeprefix("torch.")
    try:
        name = np.dtype(store_dtype).name
    except TypeError:
        name = None
    if name not in _format.STORE_DTYPES:
        raise ValueError(
            "store_dtype must be float16, float32 or float64 (numpy's, torch's or their names), "
            f"got {store_dtype!r}"
        )
    store_dtype = name
    distributed = _sharded(distributed)
    fz = Featurizer(
        model,
        dim=dim,
        kind=kind,
        projector=projector,
        seed=seed,
        device=device,
        dtype=dtype,
        output_fn=output_fn,
    )
    if fz.kind.name not in kinds.KINDS:  # the manifest records the kind by its name
        why = "needs labels, which" if fz.kind.labelled else "is not a kind"
        raise ValueError(
            f"kind={kind!r} {why} a feature store does not take; its kinds are "
            f"{', '.join(kinds.KINDS)}"
        )
    n, blocks = _blocks(data, block, fz.param_dtype)
    first = next(blocks)
    fz.prepare(first, "data")
    blocks = _chain(first, blocks)
    settings = {
        "format": _format.FORMAT,
        "model": fz.fingerprint(),
        "kind": fz.kind.name,
        "dim": fz.dim,
        "projector": projector,
        "seed": fz.seed,
        "samples": n,
        "block": block,
        "num_outputs": fz.num_outputs,
        "store_dtype": store_dtype,
        "compute_dtype": str(fz.param_dtype).replace("torch.", ""),
    }
    show = sys.stderr.isatty() if progress is None else progress
    if distributed:
        return featurize_shard(fz, first, blocks, root, settings, batch_size, show)
    if (root / _format.MANIFEST).exists():
        manifest = _format.matching(root, settings, batch_size, fz, first)
        if _format.complete(manifest):  # only read: check the data against the manifest
            _format.write_blocks(fz, blocks, root, manifest, [], None, False)
            return open_store(root, verify=False)
    make_directory(root)
    with _format.writer_lock(root):
        manifest = _format.load_or_create(root, settings, batch_size, fz, first)
        todo = [i for i in range(manifest["num_blocks"]) if str(i) not in manifest["blocks"]]

        def record(i: int, digests: dict) -> None:
            manifest["blocks"][str(i)] = digests
            _format.write_manifest(root, manifest)

        _format.write_blocks(fz, blocks, root, manifest, todo, record, show)
    return open_store(root, verify=False)


def _sharded(distributed: bool | None) -> bool:
    """Whether to featurise on all ranks of the process group; refuse `distributed=True` without
    an initialised group of several processes, and a torchrun job that never initialised its
    group (every process would act as rank 0)."""
    world = rank_and_world()[1]
    launched = os.environ.get("WORLD_SIZE", "1")
    if distributed is None and world == 1 and launched not in ("", "0", "1"):
        raise ValueError(
            f"WORLD_SIZE={launched} (a torchrun job?) but no torch.distributed process group is "
            "initialised: call torch.distributed.init_process_group() first, or pass "
            "distributed=False to featurise on this process alone"
        )
    if distributed and world < 2:
        raise ValueError(
            "distributed=True needs an initialised torch.distributed process group of more "
            f"than one process (this one has {world}); launch with torchrun and call "
            "torch.distributed.init_process_group() first"
        )
    return world > 1 if distributed is None else bool(distributed)


def _blocks(data, block: int, cast: torch.dtype):
    """(number of samples, iterator over model inputs of `block` samples each); numpy arrays of
    floats, given or yielded by a DataLoader, in `cast` (the computation's dtype)."""
    if isinstance(data, DataLoader):
        if data.batch_size is None and data.batch_sampler is None:
            raise ValueError(
                "the DataLoader yields single samples (batch_size=None), not batches; give it "
                "a batch_size"
            )
        if not isinstance(getattr(data.batch_sampler, "sampler", data.sampler), SequentialSampler):
            raise ValueError(
                "the DataLoader must visit samples in a fixed order (shuffle=False) "
                "so that an interrupted run can resume"
            )
        # numpy samples: the default collate makes tensors of the arrays' dtype, cast here
        collated = len(data.dataset) > 0 and _holds_numpy(_model_input(data.dataset[0]))
        batches = (inputs.from_numpy(_model_input(b), "data", cast) for b in data)
        if collated:
            batches = (inputs.convert(b, torch.device("cpu"), cast) for b in batches)
        return len(data.dataset), _rebatch(batches, block)
    if isinstance(data, TensorDataset):
        data = data.tensors[0]
    elif isinstance(data, torch.utils.data.Dataset):
        raise TypeError(
            "data must be a tensor (or tuple/dict of tensors), a TensorDataset or a "
            f"DataLoader, got {type(data).__name__}; wrap it in a DataLoader"
        )
    data = inputs.from_numpy(data, "data", cast)
    n = inputs.validate(data, "data")
    return n, (inputs.take(data, slice(s, s + block)) for s in range(0, n, block))


def _model_input(batch):
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _holds_numpy(sample) -> bool:
    """Whether a dataset's sample (its model input) is numpy: an array or number, alone or in a
    tuple/list/dict."""
    leaves = list(sample.values()) if isinstance(sample, dict) else sample
    if not isinstance(leaves, (tuple, list)):
        leaves = [leaves]
    return any(isinstance(leaf, (np.ndarray, np.generic)) for leaf in leaves)


def _rebatch(batches, block: int):
    """Regroup batches of any size into blocks of `block` samples (the last may be shorter)."""
    pending, count = [], 0
    for b in batches:
        pending.append(b)
        count += inputs.count(b)
        while count >= block:
            whole = _concat(pending)
            yield inputs.take(whole, slice(0, block))
            rest = inputs.take(whole, slice(block, None))
            count -= block
            pending = [rest] if count else []
    if count:
        yield _concat(pending)


def _concat(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    return tuple(torch.cat(ts) for ts in zip(*parts))


def _chain(first, rest):
    yield first
    yield from rest
