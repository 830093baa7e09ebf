"""The on-disk format of a feature store, shared by the local writer (`projections.store`) and the
sharded one (`projections.distributed`).

A store is a directory with

- ``features.npy``: one preallocated array [N, k] (`sum_logits`) or [N, O, k], written block by
  block through a memory map;
- ``manifest.json``: the settings (model fingerprint, kind, k, projector, seed, dtypes, sample
  count, block and batch sizes), the SHA-256 of those settings, and for every complete block the
  SHA-256 of its rows (``features``) and of the model inputs they were computed from
  (``inputs``);
- ``lock``: held (`fcntl.flock`) by the one process that writes the store, with its pid and
  host; the operating system releases it when that process dies. Its next holder deletes the
  temporary files (``manifest.json.<pid>.tmp``, ``features.npy.<pid>.tmp``) of a writer killed
  before renaming them.

Every field of the manifest is checked against the others, against their checksum and against
the array's header, so that an edited manifest is refused rather than believed. A block counts as
complete once its rows are flushed and a manifest naming it has been atomically renamed over the
old one, and only after every block already complete has been matched against the inputs of the
current run: a store never mixes the features of two data sets. Nor of two models: besides the
fingerprint of the model's tensors, the first sample's features are recomputed by the requesting
model and compared (`check_same_model`), which sees a forward pass or output_fn of its own.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ntk.core import inputs, kinds
from ntk.core.files import atomic_path, directory_path, writes_to
from ntk.core.kinds import KINDS
from ntk.core.tiles import require_finite_cast

from ._projectors import PROJECTORS

# /3: Rademacher signs drawn as random bits (other values than /2 for the same seed)
# /4: the projection route of a factored weight counts memory passes (`_sketch.PASS_COST`): some
#     convolutions' projections changed from their factors' matrices to a dense one
# /5: a factored weight projected through its gradient uses its factors' matrices too (the dense
#     one made the cross terms of samples on different routes zero in expectation)
FORMAT = "ntk-feature-store/5"
MANIFEST, ARRAY, LOCK, JOURNAL = "manifest.json", "features.npy", "lock", "journal"
# a writer's temporary files (named by its pid), renamed over the manifest or array when written
_TEMPORARY = re.compile(rf"(?:{re.escape(MANIFEST)}|{re.escape(ARRAY)})\.\d+\.tmp")
# every entry a writer makes, a killed writer's temporary files included
_WRITTEN = re.compile(
    rf"{re.escape(MANIFEST)}|{re.escape(ARRAY)}|{LOCK}|{JOURNAL}|{_TEMPORARY.pattern}"
)
STORE_DTYPES = ("float16", "float32", "float64")
# an open refused by a file's permission or a read-only mount: not a damaged store
_NOT_PERMITTED = (errno.EACCES, errno.EPERM, errno.EROFS)
_FIELDS = {  # the manifest's fields and their JSON types, besides "blocks"
    "format": str,
    "model": str,
    "kind": str,
    "dim": int,
    "projector": str,
    "seed": int,
    "samples": int,
    "block": int,
    "num_outputs": int,
    "store_dtype": str,
    "compute_dtype": str,
    "shape": list,
    "num_blocks": int,
    "batch": int,
    "settings_sha256": str,
}


class StoreError(ValueError):
    """The store does not match the request, is incomplete, damaged, being written or may not
    be opened (its permission)."""


# -- the manifest --------------------------------------------------------------------------------


def new_manifest(settings: dict, batch: int) -> dict:
    """The manifest of an empty store with `settings` (the fields the caller decides)."""
    n, dim, o = settings["samples"], settings["dim"], settings["num_outputs"]
    manifest = {
        **settings,
        "shape": [n, dim] if kinds.get(settings["kind"]).feature_axes() == 2 else [n, o, dim],
        "num_blocks": -(-n // settings["block"]),
        "batch": batch,
    }
    manifest["settings_sha256"] = _settings_digest(manifest)
    manifest["blocks"] = {}
    return manifest


def store_root(path) -> Path:
    """The directory of a feature store named by `path`; refuse what is not a path, or a file."""
    return directory_path(path, "a feature store")


def read_manifest(root: Path) -> dict:
    """The manifest of the store at `root`, checked field by field (`check_manifest`)."""
    file = root / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise StoreError(f"{root} is not a feature store (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"cannot read {file}: {e}") from None
    check_manifest(manifest, file)
    return manifest


def check_manifest(manifest, file: Path) -> None:
    """Refuse a manifest whose fields are missing, mistyped, out of range, inconsistent with each
    other, or edited since they were written (their checksum differs)."""

    def bad(what: str):
        return StoreError(f"{file} is damaged or was edited: {what}; featurize into a new path")

    if not isinstance(manifest, dict):
        raise bad("it is not a JSON object")
    fmt = manifest.get("format")
    if fmt != FORMAT:
        older = isinstance(fmt, str) and fmt.startswith("ntk-feature-store/")
        raise StoreError(
            f"{file} is a {fmt} manifest, written by another version of the toolkit (this one "
            f"reads {FORMAT}); featurize into a new path"
            if older
            else f"{file} is not a {FORMAT} manifest"
        )
    for key, kind in {**_FIELDS, "blocks": dict}.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise bad(f"{key} is {value!r}, not a JSON {kind.__name__}")
    for key in ("dim", "samples", "block", "num_outputs", "batch"):
        if manifest[key] < 1:
            raise bad(f"{key} is {manifest[key]}, not a positive integer")
    for key, allowed in (
        ("kind", KINDS),
        ("projector", PROJECTORS),
        ("store_dtype", STORE_DTYPES),
        ("compute_dtype", STORE_DTYPES + ("bfloat16",)),
    ):
        if manifest[key] not in allowed:
            raise bad(f"{key} is {manifest[key]!r}, not one of {', '.join(allowed)}")
    n, block = manifest["samples"], manifest["block"]
    expected = new_manifest({k: manifest[k] for k in _settings_keys()}, manifest["batch"])
    for key in ("shape", "num_blocks"):
        if manifest[key] != expected[key]:
            raise bad(
                f"{key} is {manifest[key]}, but {n} samples in blocks of {block} with these "
                f"settings give {expected[key]}"
            )
    if manifest["batch"] > block:
        raise bad(f"batch {manifest['batch']} exceeds the block size {block}")
    if manifest["settings_sha256"] != expected["settings_sha256"]:
        raise bad("its settings do not match their checksum (settings_sha256)")
    for key, entry in manifest["blocks"].items():
        if key not in map(str, range(manifest["num_blocks"])):
            raise bad(f"it lists block {key!r} of a store of {manifest['num_blocks']} blocks")
        if not (
            isinstance(entry, dict)
            and set(entry) == {"features", "inputs"}
            and all(_is_sha256(v) for v in entry.values())
        ):
            raise bad(f"block {key} is {entry!r}, not its features' and inputs' SHA-256")


def _settings_keys() -> list:
    return [k for k in _FIELDS if k not in ("shape", "num_blocks", "batch", "settings_sha256")]


def _settings_digest(manifest: dict) -> str:
    fields = {k: manifest[k] for k in _FIELDS if k != "settings_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _is_sha256(value) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def write_manifest(root: Path, manifest: dict) -> None:
    """Replace the manifest atomically (through a temporary file of this process); a failed
    write names it (`atomic_path`)."""
    temporary = f"{MANIFEST}.{os.getpid()}.tmp"
    with (
        atomic_path(root / MANIFEST, temporary=temporary, durable=True) as tmp,
        open(tmp, "w") as f,
    ):
        json.dump(manifest, f, indent=1)


def matching(root: Path, settings: dict, batch_size, fz, first) -> dict:
    """The existing store's manifest, refused unless it was written with `settings` (and
    `batch_size`, unless None), its complete blocks hold the bytes they were written with and
    its first sample's features are those the Featurizer `fz` gives on `first`, the data's first
    block (`check_same_model`)."""
    manifest = read_manifest(root)
    diff = [
        f"{k}: store has {manifest[k]!r}, requested {v!r}"
        for k, v in settings.items()
        if manifest[k] != v and k != "model"
    ]
    if diff:
        raise StoreError(
            f"the store at {root} was written with other settings ({'; '.join(diff)}); "
            "use another path"
        )
    if manifest["model"] != settings["model"]:
        raise StoreError(
            f"the store at {root} was written by a different model (parameter fingerprint "
            f"{manifest['model'][:12]}…, this model {settings['model'][:12]}…); use another path"
        )
    if batch_size is not None and batch_size != manifest["batch"]:
        state = "was written" if complete(manifest) else "is being written"
        raise StoreError(
            f"the store at {root} {state} with batch_size={manifest['batch']}; featurize into "
            "it with the same batch_size (or None)"
        )
    array = open_array(root, manifest)
    verify_features(array, manifest, root)
    check_same_model(fz, first, root, manifest, array)
    return manifest


# How far the features of the store's first sample, recomputed by the requesting model, may lie
# from the stored ones (‖Δ‖ / ‖stored‖): rounding of another batch (≈ 1e-7), another machine's
# int8 projection path (≈ 2e-5) or the store's float16 (≈ 5e-4) stays below; a model with the
# same parameters and another forward pass (Tanh for ReLU: 0.55) lies far above.
SAME_MODEL_TOLERANCE = {"float16": 1e-2, "float32": 1e-3, "float64": 1e-3}


def check_same_model(fz, first, root: Path, manifest: dict, array: np.ndarray) -> None:
    """Refuse a store (its `array`, opened) whose first sample's features are not those that
    the Featurizer `fz` (prepared) gives on `first`, the data's first block: the parameter
    fingerprint does not see the forward code, parameter-free modules (an activation) or the
    output_fn, and a resume by such a model mixed two models' features in one store. Checked
    where block 0 is complete and was written from these data (other data are named by the
    data check)."""
    entry = manifest["blocks"].get("0")
    if entry is None or inputs.digest(first) != entry["inputs"]:
        return
    stored = array[0].astype(np.float64)
    fresh = fz.block(inputs.take(first, slice(0, 1)))[0].detach().cpu().double().numpy()
    scale = float(np.linalg.norm(stored))
    gap = float(np.linalg.norm(fresh - stored)) / (scale if scale > 0 else 1.0)
    if not gap <= SAME_MODEL_TOLERANCE[manifest["store_dtype"]]:
        raise StoreError(
            f"the store at {root} holds features of its first sample that this model does not "
            f"give (relative difference {gap:.2g}): it was written by a model with the same "
            "parameters but another forward pass (architecture, activation, output_fn); use "
            "another path"
        )


def load_or_create(root: Path, settings: dict, batch_size, fz, first) -> dict:
    """The manifest of the store at `root` (checked against the request, `matching`), or of a new
    empty store there. The caller holds the store's lock."""
    if (root / MANIFEST).exists():
        return matching(root, settings, batch_size, fz, first)
    batch = min(batch_size or fz.default_batch(settings["samples"]), settings["block"])
    manifest = new_manifest(settings, batch)
    create_array(root, manifest)
    write_manifest(root, manifest)
    return manifest


def complete(manifest: dict) -> bool:
    return len(manifest["blocks"]) == manifest["num_blocks"]


# -- the array -----------------------------------------------------------------------------------


def create_array(root: Path, manifest: dict) -> None:
    """Preallocate features.npy (through a temporary file, so it is never half created), its
    disk space reserved (`posix_fallocate`): a disk too small fails here, "No space left on
    device", rather than with SIGBUS when a block is written through the memory map into a sparse
    file. A failed write names it (`atomic_path`)."""
    with atomic_path(root / ARRAY, temporary=f"{ARRAY}.{os.getpid()}.tmp") as tmp:
        np.lib.format.open_memmap(
            tmp, mode="w+", dtype=manifest["store_dtype"], shape=tuple(manifest["shape"])
        ).flush()
        if hasattr(os, "posix_fallocate"):  # not on macOS, whose files are then sparse
            fd = os.open(tmp, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)


def open_array(root: Path, manifest: dict, mode: str = "r") -> np.ndarray:
    """features.npy as a memory map, refused unless its header agrees with the manifest. A file
    that may not be opened in `mode` (its permission, a read-only mount) is said to be so, not
    damaged."""
    file = root / ARRAY
    try:
        array = np.load(file, mmap_mode=mode, allow_pickle=False)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno in _NOT_PERMITTED:
            purpose = "reading" if mode == "r" else "writing"
            raise StoreError(f"cannot open {file} for {purpose}: {e.strerror}") from None
        raise StoreError(f"cannot read {file} (truncated or damaged?): {e}") from None
    if list(array.shape) != manifest["shape"] or array.dtype.name != manifest["store_dtype"]:
        raise StoreError(
            f"{file} holds {array.dtype.name} {list(array.shape)}, the manifest says "
            f"{manifest['store_dtype']} {manifest['shape']}"
        )
    return array


def rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


def verify_features(array: np.ndarray, manifest: dict, root: Path) -> None:
    """Recompute every complete block's SHA-256 and refuse a store whose bytes changed."""
    block = manifest["block"]
    for key, entry in manifest["blocks"].items():
        i = int(key)
        if rows_digest(array[i * block : (i + 1) * block]) != entry["features"]:
            raise StoreError(
                f"block {i} of the store at {root} ({_samples(i, manifest)}) is corrupted: its "
                "checksum does not match the manifest; delete the store and featurize again"
            )


def _samples(i: int, manifest: dict) -> str:
    block = manifest["block"]
    return f"samples {i * block}–{min((i + 1) * block, manifest['samples']) - 1}"


def open_store(path: str | os.PathLike, *, verify: bool = True) -> np.ndarray:
    """The features of a complete store as a read-only memory-mapped array, [N, k] or [N, O, k].

    verify: recompute every block's SHA-256 and refuse a corrupted store (reads the whole file).
    Use `projections.kernel(open_store(p), kind=store_info(p)["kind"])` for Φ Φᵀ in tiles.
    """
    root = store_root(path)
    manifest = read_manifest(root)
    if not complete(manifest):
        missing = manifest["num_blocks"] - len(manifest["blocks"])
        raise StoreError(
            f"the store at {root} is incomplete: {missing} of {manifest['num_blocks']} blocks "
            "missing; run projections.featurize again with the same settings to resume"
        )
    array = open_array(root, manifest)
    if verify:
        verify_features(array, manifest, root)
    return array


def foreign_files(path: str | os.PathLike) -> list[str]:
    """The entries of the directory `path` that no store writer makes: none in a store (complete,
    or partly written by a process killed before its manifest) or in an empty directory. A
    writer takes its lock before it writes anything, so without the lock every entry is foreign
    (a user's own features.npy was taken for a killed writer's)."""
    root = Path(path)
    if (root / MANIFEST).exists():
        return []
    names = sorted(p.name for p in root.iterdir())
    if LOCK not in names:
        return names
    return [name for name in names if not _WRITTEN.fullmatch(name)]


def check_not_foreign(path: str | os.PathLike) -> None:
    """Refuse a directory at `path` that holds entries no store writer makes (`foreign_files`):
    a store is never written among, or over, other files."""
    root = Path(path)
    foreign = foreign_files(root) if root.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
        raise StoreError(
            f"{root} is a directory of other files ({shown}), not a feature store; name a new or "
            "empty one"
        )


def is_complete(path: str | os.PathLike) -> bool:
    """Whether `path` holds a complete store (a readable manifest listing every block): one that
    `featurize` only reads, so it may sit in a read-only directory; False for anything else
    (a file, a directory without a manifest, one that cannot be read), which `featurize` names."""
    try:
        return complete(read_manifest(store_root(path)))
    except (TypeError, ValueError, OSError):  # StoreError is a ValueError
        return False


def store_info(path: str | os.PathLike) -> dict:
    """The manifest of the store at `path` (settings, shape, complete blocks), checked."""
    return read_manifest(store_root(path))


# -- writing -------------------------------------------------------------------------------------


def write_blocks(
    fz,
    blocks,
    root: Path,
    manifest: dict,
    todo: list,
    record: Callable[[int, dict], None],
    show: bool,
) -> None:
    """Featurise the blocks numbered in `todo` (of the iterator `blocks`, a `Featurizer` `fz`)
    into the store's array, and check the inputs of the blocks already complete against the
    manifest on the way (a differing block is refused, by number).

    `record(i, {"features": sha256, "inputs": sha256})` marks block i complete once its rows are
    flushed and every complete block has been matched; the digests of the inputs are taken from
    the blocks as they stream past, with no second pass over the data."""
    done = {int(k): v["inputs"] for k, v in manifest["blocks"].items()}
    wanted = set(todo)
    last = max(wanted | set(done), default=-1)
    checked_up_to = max(done, default=-1)  # new blocks are recorded once these are matched
    block, n = manifest["block"], manifest["samples"]
    array, pending, i = None, [], -1
    with tqdm(total=len(wanted), disable=not show, desc="featurize", unit="block") as bar:
        for i, x in enumerate(blocks):
            if i > last:
                break
            size = inputs.count(x)
            if size != min(block, n - i * block):
                raise ValueError(
                    f"block {i} of the data holds {size} samples, expected "
                    f"{min(block, n - i * block)}: the data yields fewer or more samples than "
                    f"its length ({n})"
                )
            digest = inputs.digest(x)
            if i in done and digest != done[i]:
                raise StoreError(
                    f"the data differ from those the store at {root} was written from, first in "
                    f"block {i} ({_samples(i, manifest)}); featurize other data into another path"
                )
            if i in wanted:
                if array is None:
                    array = open_array(root, manifest, "r+")
                fz.prepare(x, "data")
                start = i * block
                for s in range(0, size, manifest["batch"]):
                    part = fz.block(inputs.take(x, slice(s, s + manifest["batch"])))
                    part = part.detach().cpu()  # one copy to the host, for both checks
                    if part.dtype == torch.bfloat16:  # numpy has none; float32 holds each value
                        part = part.float()
                    part = part.numpy()
                    with np.errstate(over="ignore"):  # an overflow is refused just below
                        values = part.astype(manifest["store_dtype"])
                    what = f"the features of block {i} ({_samples(i, manifest)})"
                    dtype = f"store_dtype={manifest['store_dtype']!r}"
                    # `block` checked them finite before the cast
                    require_finite_cast(values, what, f"{dtype}; use a wider store_dtype")
                    _require_kept(part, values, what, dtype, first=start + s)
                    array[start + s : start + s + part.shape[0]] = values
                with writes_to(root / ARRAY):
                    array.flush()
                rows = array[start : start + size]
                pending.append((i, {"features": rows_digest(rows), "inputs": digest}))
            if i >= checked_up_to:
                for entry in pending:
                    record(*entry)
                    bar.update()
                pending = []
        else:
            if last >= 0 and i < last:
                raise ValueError(f"the data ended after block {i}, expected {last + 1} blocks")
    del array


# The share of a sample's features (‖cast − φ‖ / ‖φ‖) that the cast into store_dtype may lose:
# float16 rounds by ≈ 3e-4; features below its normal range (6e-5) flush to subnormals or zero,
# and lose far more (99 % of them zero at a scale of 1e-7: the kernel 88 % off).
CAST_LOSS = 1e-2


def _require_kept(
    features: np.ndarray, cast: np.ndarray, what: str, dtype: str, first: int = 0
) -> None:
    """Refuse a cast of the features into the store's dtype that loses more than CAST_LOSS of
    any one sample's (its scale below the dtype's range, whatever the others' scale; `first`:
    the index of the batch's first sample)."""
    exact = features.astype(np.float64).reshape(len(features), -1)
    error = cast.astype(np.float64).reshape(len(features), -1) - exact
    scale = np.linalg.norm(exact, axis=1)
    lost = np.linalg.norm(error, axis=1) / np.where(scale > 0, scale, 1.0)
    worst = int(np.argmax(lost))  # a batch holds at least one sample
    if lost[worst] > CAST_LOSS:
        raise ValueError(
            f"{what} lose {lost[worst]:.2g} of their norm in {dtype} (sample {first + worst}): "
            "their scale lies below its range; use a wider store_dtype"
        )


def _lock_holder(fd: int, attempts: int = 50, wait: float = 0.002) -> str:
    """The holder named in the lock file: the holder writes its pid and host just after taking
    the lock, so an empty or partial record is read again for up to attempts × wait seconds."""
    for attempt in range(attempts):
        try:
            who = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
            return f"process {who['pid']} on {who['host']}"
        except (ValueError, TypeError, KeyError):
            if attempt + 1 < attempts:
                time.sleep(wait)
    return "another process"


def _remove_temporaries(root: Path) -> None:
    """Delete the temporary files of writers killed before renaming them: called by the lock's
    holder, the one writer, so none of them is in use."""
    for entry in root.iterdir():
        if _TEMPORARY.fullmatch(entry.name):
            entry.unlink(missing_ok=True)


@contextmanager
def writer_lock(root: Path):
    """Hold the store's lock while writing; refuse (naming the holder) while another process
    holds it. The lock dies with its process, so a killed writer never blocks the next one.
    A lock file that may not be opened for writing (its permission, a read-only mount, a
    directory in its place) is refused as such before anything is written, as `open_array`
    refuses the array ("cannot open …/lock for writing: Permission denied")."""
    file = root / LOCK
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno in (*_NOT_PERMITTED, errno.EISDIR):
            raise StoreError(f"cannot open {file} for writing: {e.strerror}") from None
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _lock_holder(fd)
            raise StoreError(
                f"the store at {root} is being written by {who}; wait for it to finish, or stop "
                "it, before featurizing into it (one writer at a time)"
            ) from None
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        with writes_to(root / LOCK):
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        _remove_temporaries(root)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
