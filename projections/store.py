"""A resumable on-disk store of projected features, for kernels larger than memory.

A store is a directory with

- ``features.npy``: one preallocated array [N, k] (`sum_logits`) or [N, O, k], written block by
  block through a memory map;
- ``manifest.json``: what the features are (model fingerprint, kind, k, projector, seed, dtypes,
  sample count, block size) and the SHA-256 of every complete block.

A block counts as complete only once its rows are flushed and a new manifest naming it has been
written to a temporary file and atomically renamed over the old one, so an interrupted run never
leaves a half-written block that looks complete; `featurize` on the same path resumes with the
missing blocks and produces the same bytes as an uninterrupted run. Stores written with other
settings or another model, and truncated or corrupted blocks, are refused with `StoreError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset
from tqdm.auto import tqdm

from ntk.core import inputs, kinds
from ntk.distributed import rank_and_world

from .projected import Featurizer

FORMAT = "ntk-feature-store/1"
_MANIFEST, _ARRAY = "manifest.json", "features.npy"
_EXIT_HOOK = "NTK_FEATURIZE_EXIT_AFTER_BLOCKS"  # testing: os._exit(3) after this many new blocks


class StoreError(ValueError):
    """The store does not match the request, is incomplete, or is damaged."""


def featurize(
    model: nn.Module,
    data,
    path: str | os.PathLike,
    *,
    dim: int,
    kind: str = "trace",
    projector: str = "rademacher",
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

    data: a tensor (or tuple/dict of tensors) with samples first, a `TensorDataset` (its first
    tensor is the model input) or a `DataLoader` with a sequential sampler (batches that are
    tuples/lists use their first element). `batch_size` samples are featurised at a time
    (None: chosen from free memory on the first run, then reused so that a resumed run repeats
    the same arithmetic). `progress`: a tqdm bar (None: only on a terminal).
    distributed: share the blocks among the ranks of the torch.distributed process group, every
    rank calling with the same arguments (None: whenever a group of more than one process is
    initialised); see `projections.distributed`.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    store_dtype = np.dtype(store_dtype).name
    if store_dtype not in ("float16", "float32", "float64"):
        raise ValueError(f"store_dtype must be float16, float32 or float64, got {store_dtype!r}")
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
    n, blocks = _blocks(data, block)
    first = next(blocks)
    fz.prepare(first)
    root = Path(path)
    settings = {
        "format": FORMAT,
        "model": fz.fingerprint(),
        "kind": kind,
        "dim": dim,
        "projector": projector,
        "seed": seed,
        "samples": n,
        "block": block,
        "num_outputs": fz.num_outputs,
        "store_dtype": store_dtype,
        "compute_dtype": str(fz.param_dtype).replace("torch.", ""),
    }
    show = sys.stderr.isatty() if progress is None else progress
    if distributed is None:
        distributed = rank_and_world()[1] > 1
    if distributed:
        from .distributed import featurize_shard

        return featurize_shard(fz, _chain(first, blocks), root, settings, batch_size, show)
    manifest = _load_or_create(root, settings, batch_size, fz, n)
    todo = [i for i in range(manifest["num_blocks"]) if str(i) not in manifest["blocks"]]

    def record(i: int, digest: str) -> None:
        manifest["blocks"][str(i)] = digest
        _write_manifest(root, manifest)

    write_blocks(fz, _chain(first, blocks), root, manifest, todo, record, show)
    return open_store(root, verify=False)


def write_blocks(
    fz: Featurizer,
    blocks,
    root: Path,
    manifest: dict,
    todo: list,
    record: Callable[[int, str], None],
    show: bool,
) -> None:
    """Featurise the blocks numbered in `todo` (of the iterator `blocks`) into the store's
    array; after each block's rows are flushed, `record(i, sha256)` marks it complete."""
    batch, block, store_dtype = manifest["batch"], manifest["block"], manifest["store_dtype"]
    array = np.load(root / _ARRAY, mmap_mode="r+")
    wanted = set(todo)
    exit_after = int(os.environ.get(_EXIT_HOOK, "0"))
    written = 0
    with tqdm(total=len(todo), disable=not show, desc="featurize", unit="block") as bar:
        for i, x in enumerate(blocks):
            if written == len(wanted):
                break
            if i not in wanted:
                continue
            rows = slice(i * block, i * block + inputs.count(x))
            fz.prepare(x)
            for start in range(0, inputs.count(x), batch):
                part = fz.block(inputs.take(x, slice(start, start + batch)))
                array[rows.start + start : rows.start + start + part.shape[0]] = (
                    part.detach().cpu().numpy().astype(store_dtype)
                )
            array.flush()
            record(i, _digest(array[rows]))
            bar.update()
            written += 1
            if exit_after and written >= exit_after:
                os._exit(3)
    del array


def open_store(path: str | os.PathLike, *, verify: bool = True) -> np.ndarray:
    """The features of a complete store as a read-only memory-mapped array, [N, k] or [N, O, k].

    verify: recompute every block's SHA-256 and refuse a corrupted store (reads the whole file).
    Use `projections.kernel(open_store(p), kind=store_info(p)["kind"])` for Φ Φᵀ in tiles.
    """
    root = Path(path)
    manifest = store_info(root)
    missing = manifest["num_blocks"] - len(manifest["blocks"])
    if missing:
        raise StoreError(
            f"the store at {root} is incomplete: {missing} of {manifest['num_blocks']} "
            "blocks missing; run projections.featurize again with the same settings "
            "to resume"
        )
    array = _open_array(root, manifest)
    if verify:
        _verify(array, manifest, root)
    return array


def store_info(path: str | os.PathLike) -> dict:
    """The manifest of the store at `path` (settings, shape, complete blocks)."""
    file = Path(path) / _MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path} is not a feature store (no {_MANIFEST})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"cannot read {file}: {e}") from None
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{file} is not a {FORMAT} manifest")
    return manifest


# --------------------------------------------------------------------------------------------


def _load_or_create(root: Path, settings: dict, batch_size, fz: Featurizer, n: int) -> dict:
    if (root / _MANIFEST).exists():
        manifest = store_info(root)
        diff = [
            f"{k}: store has {manifest.get(k)!r}, requested {v!r}"
            for k, v in settings.items()
            if manifest.get(k) != v and k != "model"
        ]
        if diff:
            raise StoreError(
                f"the store at {root} was written with other settings ("
                + "; ".join(diff)
                + "); use another path"
            )
        if manifest["model"] != settings["model"]:
            raise StoreError(
                f"the store at {root} was written by a different model (parameter "
                f"fingerprint {manifest['model'][:12]}…, this model "
                f"{settings['model'][:12]}…); use another path"
            )
        if batch_size is not None and batch_size != manifest["batch"]:
            raise StoreError(
                f"the store at {root} is being written with batch_size="
                f"{manifest['batch']}; resume with the same batch_size (or None)"
            )
        _verify(_open_array(root, manifest), manifest, root)
        return manifest
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    root.mkdir(parents=True, exist_ok=True)
    shape = (
        (n, settings["dim"])
        if kinds.get(settings["kind"]).feature_axes() == 2
        else (n, settings["num_outputs"], settings["dim"])
    )
    tmp = root / (_ARRAY + ".tmp")
    np.lib.format.open_memmap(tmp, mode="w+", dtype=settings["store_dtype"], shape=shape).flush()
    os.replace(tmp, root / _ARRAY)
    manifest = {
        **settings,
        "shape": list(shape),
        "num_blocks": -(-n // settings["block"]),
        "batch": min(batch_size or fz.default_batch(n), settings["block"]),
        "blocks": {},
    }
    _write_manifest(root, manifest)
    return manifest


def _open_array(root: Path, manifest: dict) -> np.ndarray:
    file = root / _ARRAY
    try:
        array = np.load(file, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read {file} (truncated or damaged?): {e}") from None
    if list(array.shape) != manifest["shape"] or array.dtype.name != manifest["store_dtype"]:
        raise StoreError(
            f"{file} holds {array.dtype.name} {list(array.shape)}, the manifest "
            f"says {manifest['store_dtype']} {manifest['shape']}"
        )
    return array


def _verify(array: np.ndarray, manifest: dict, root: Path) -> None:
    block = manifest["block"]
    for key, digest in manifest["blocks"].items():
        i = int(key)
        if _digest(array[i * block : (i + 1) * block]) != digest:
            raise StoreError(
                f"block {i} of the store at {root} (samples {i * block}–"
                f"{min((i + 1) * block, manifest['samples']) - 1}) is corrupted: its "
                "checksum does not match the manifest; delete the store and "
                "featurize again"
            )


def _digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


def _write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / _MANIFEST)


def _blocks(data, block: int):
    """(number of samples, iterator over model inputs of `block` samples each)."""
    if isinstance(data, DataLoader):
        if not isinstance(getattr(data.batch_sampler, "sampler", data.sampler), SequentialSampler):
            raise ValueError(
                "the DataLoader must visit samples in a fixed order (shuffle=False) "
                "so that an interrupted run can resume"
            )
        return len(data.dataset), _rebatch((_model_input(b) for b in data), block)
    if isinstance(data, TensorDataset):
        data = data.tensors[0]
    elif isinstance(data, torch.utils.data.Dataset):
        raise TypeError(
            "data must be a tensor (or tuple/dict of tensors), a TensorDataset or a "
            f"DataLoader, got {type(data).__name__}; wrap it in a DataLoader"
        )
    n = inputs.validate(data, "data")
    return n, (inputs.take(data, slice(s, s + block)) for s in range(0, n, block))


def _model_input(batch):
    return batch[0] if isinstance(batch, (tuple, list)) else batch


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
