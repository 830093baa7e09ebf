"""Kernels on torch.distributed: the tile grid of a kernel spread over the ranks of a process group.

Launch one process per device with PyTorch's own launcher (``torchrun --nproc_per_node=K
script.py``; NCCL on GPUs, Gloo on CPUs), call ``torch.distributed.init_process_group()`` (with
NCCL after ``torch.cuda.set_device(local_rank)``: object collectives use the current device) and
then `empirical_ntk` on every rank with the same model and inputs. The tiles that one process
would compute (row-major; j ≥ i for a symmetric kernel) are cut into contiguous, equally long
runs, one per rank, so the assignment depends only on the grid and the world size. Each tile is
computed exactly as in one process, so with the same `batch_size` the kernel has the same bits.

Results are either gathered to rank 0 (``path=None``) or written by every rank as tile files
under ``path`` (a directory on a filesystem all ranks share); `load_tiles` assembles them.
Without an initialised process group everything runs in this process (world size 1).
"""

from __future__ import annotations

import functools
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .core import kinds
from .core.files import atomic_path, directory_path, make_directory
from .core.tiles import Grid
from .empirical import Kernel, _Computation

TILES_FORMAT = "ntk-kernel-tiles/1"
_INDEX, _TILES = "index.json", "tiles"
_WRITTEN = {_INDEX, _INDEX + ".part", _TILES}  # everything `_write_tiles` makes
_TILE_FILE = re.compile(r"\d+_\d+(\.part)?\.npz")  # the files it writes under _TILES


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(n: int, rank: int, world: int) -> range:
    """The contiguous share of items 0..n-1 that `rank` owns: lengths differ by at most one."""
    return range(n * rank // world, n * (rank + 1) // world)


class RankFailed(Exception):
    """Another rank of the process group failed (`agree`): `rank`, and its exception's type name
    (`kind`) and message, as in "rank 1 failed: OSError: [Errno 28] No space left on device:
    'K/tiles/0_1.npz'". Raised as that exception's category too (ValueError, OSError...:
    `_CATEGORIES`), so that an `except` catches the failure on every rank alike."""

    def __init__(self, rank: int, kind: str, message: str):
        super().__init__(f"rank {rank} failed: {kind}: {message}")
        self.rank, self.kind, self.message = rank, kind, message


_CATEGORIES = (OSError, MemoryError, TypeError, ValueError, RuntimeError)


@functools.cache
def _rank_failed(category: type[Exception]) -> type[RankFailed]:
    """`RankFailed` that is also a `category` (one of `_CATEGORIES`, or Exception)."""
    return type(RankFailed.__name__, (RankFailed, category), {"__module__": __name__})


def agree(
    summary: dict, error: BaseException | None = None, *, minimum: Sequence[str] = ()
) -> dict:
    """All-gather what each rank is about to do; raise on every rank if any rank failed to set
    up (`error`: raised on its rank, `RankFailed` on the others) or if the ranks' summaries
    differ, except in the keys of `minimum`, where the smallest value wins (e.g. a block size
    chosen from each rank's free memory)."""
    rank, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return summary
    everyone: list = [None] * world
    failure = None
    if error is not None:
        category = next((c for c in _CATEGORIES if isinstance(error, c)), Exception)
        failure = (category, type(error).__name__, str(error))
    dist.all_gather_object(everyone, summary if error is None else failure)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(everyone) if isinstance(e, tuple)]
    if failed:
        r, (category, kind, message) = failed[0]
        raise _rank_failed(category)(r, kind, message)
    agreed = dict(summary, **{k: min(s[k] for s in everyone) for k in minimum})
    for r, s in enumerate(everyone):
        diff = [k for k in summary if k not in minimum and s[k] != summary[k]]
        if diff:
            raise ValueError(
                f"rank {r} disagrees with rank {rank} on {', '.join(diff)}: every "
                "rank must pass the same model, inputs and settings"
            )
    return agreed


@contextmanager
def together(*failures: type[Exception]) -> Iterator[None]:
    """Around work that may fail on one rank only: an exception of `failures` is raised on
    every rank (`agree`) once all have done their part, rather than on its rank alone while the
    others wait for it in their next collective."""
    error = None
    try:
        yield
    except failures as e:
        error = e
    agree({}, error)


def barrier() -> None:
    """torch.distributed.barrier() in a process group; nothing in a single process."""
    if rank_and_world()[1] > 1:
        dist.barrier()


def empirical_ntk(
    model: nn.Module,
    x1,
    x2=None,
    *,
    kind: str | kinds.Kind = "full",
    labels=None,
    labels2=None,
    layers: None | str | Sequence[str] = None,
    per_layer: bool | None = None,
    method: str = "auto",
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    output_fn: Callable | None = None,
    progress: bool = False,
    path: None | str | os.PathLike = None,
    out=None,
) -> Kernel | None:
    """`ntk.empirical_ntk` with its tiles computed by all the ranks of the process group.

    Call on every rank with the same arguments (a model on each rank's own device, or `device`).
    path=None: the tiles are gathered to rank 0, which returns the kernel (into `out` if given,
    as in `ntk.empirical_ntk`); the other ranks return None. path: a new or empty directory on a
    filesystem shared by all ranks; each rank writes its tiles there, nothing is gathered and
    every rank returns None once the kernel is complete (read it with `load_tiles(path)`). The
    kernel then never has to fit in memory. `batch_size` sets the tile size (None: chosen from
    the free memory of the tightest rank); with the same batch_size the kernel equals the
    single-process one bit for bit.
    """
    rank, _ = rank_and_world()
    grid = error = None
    try:
        computation = _Computation(
            model,
            kind=kind,
            layers=layers,
            per_layer=per_layer,
            method=method,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
            output_fn=output_fn,
            progress=progress,
        )
        grid = computation.grid(
            x1,
            x2,
            out if rank == 0 else None,
            labels=labels,
            labels2=labels2,
            in_memory=path is None and rank == 0,
        )
        if path is not None and rank == 0:
            check_empty(Path(path))
    except (ValueError, TypeError, MemoryError) as e:
        error = e
    return run_grid(grid, path=path, out=out, progress=progress, error=error)


def run_grid(
    grid: Grid | None,
    *,
    path=None,
    out=None,
    progress: bool = False,
    error: BaseException | None = None,
):
    """Compute `grid`'s tiles on all ranks; gather them to rank 0 (path=None: rank 0 returns the
    result, others None) or write them under `path` (returns None). `error`: this rank's set-up
    failure, raised on every rank instead of computing."""
    if path is not None and out is not None:
        raise ValueError("pass either path= (tiles on disk) or out= (gathered to rank 0), not both")
    rank, world = rank_and_world()
    summary = (
        None
        if grid is None
        else {
            "n1": grid.n1,
            "n2": grid.n2,
            "block": grid.tile_size,
            "symmetric": grid.symmetric,
            "kind": grid.kind.name,
            "shape": list(grid.shape),
            "keys": grid.keys,
            "dtype": str(grid.dtype).replace("torch.", ""),
        }
    )
    summary = agree(summary, error, minimum=("block",))
    grid.tile_size = summary["block"]
    tiles = grid.tiles()
    mine = [tiles[t] for t in shard(len(tiles), rank, world)]
    if path is not None:
        _write_tiles(grid, mine, Path(path), summary, progress and rank == 0)
        return None
    if rank == 0:
        results = grid.allocate(out)
        grid.fill(results, grid.compute(mine, progress=progress), out)
        received: list = [None] * world
        if world > 1:
            dist.gather_object(None, received, dst=0)
        for part in received[1:]:
            grid.fill(results, part, out)
        return grid.result(results)
    part = [
        (i, j, {k: v.detach().cpu() for k, v in values.items()})
        for i, j, values in grid.compute(mine)
    ]
    dist.gather_object(part, None, dst=0)
    return None


def load_tiles(path: str | os.PathLike, *, out=None) -> Kernel:
    """Assemble the kernel that `empirical_ntk(..., path=path)` wrote: a tensor, or a dict per
    layer; `out` (e.g. `numpy.lib.format.open_memmap`) receives a total kernel instead."""
    root = directory_path(path, "kernel tiles")
    if not root.exists():
        raise ValueError(f"path {root} does not exist (no kernel tiles there)")
    try:
        index = json.loads((root / _INDEX).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{root} holds no complete kernel (no {_INDEX}); was the job interrupted?"
        ) from None
    if index.get("format") != TILES_FORMAT:
        raise ValueError(f"{root / _INDEX} is not a {TILES_FORMAT} index")
    keys = index["keys"]
    if out is not None and keys != [None]:
        raise ValueError("out= receives a total kernel only; this path holds layer components")
    grid = Grid(
        n1=index["n1"],
        n2=index["n2"],
        tile_size=index["block"],
        symmetric=index["symmetric"],
        kind=index["kind"],
        shape=index["shape"],
        keys=keys,
        dtype=getattr(torch, index["dtype"]),
        device=torch.device("cpu"),
        row_features=None,
        col_features=None,
        contract=None,
        cache_ok=False,
        desc="",
    )
    results = grid.allocate(out)
    grid.fill(results, (_read_tile(root, grid, results, i, j) for i, j in grid.tiles()), out)
    return grid.result(results)


def _read_tile(root: Path, grid: Grid, results: dict, i: int, j: int) -> tuple[int, int, dict]:
    """Tile (i, j) of the kernel under `root`, refused if missing, unreadable or misshapen."""
    file = root / _TILES / f"{i}_{j}.npz"
    try:
        with np.load(file) as tile:
            values = {k: torch.from_numpy(tile[f"c{c}"]) for c, k in enumerate(grid.keys)}
    except FileNotFoundError:
        raise ValueError(f"tile {file} of the kernel at {root} is missing") from None
    except OSError as e:
        raise ValueError(f"cannot read tile {file} of the kernel at {root}: {e}") from None
    except (ValueError, KeyError, EOFError, zipfile.BadZipFile):
        raise ValueError(
            f"tile {file} of the kernel at {root} is damaged: not the .npz of arrays that "
            "empirical_ntk writes"
        ) from None
    for k, value in values.items():
        want = tuple(results[k][grid.rows[i], grid.cols[j]].shape)
        if tuple(value.shape) != want:
            raise ValueError(
                f"tile {file} of the kernel at {root} has shape {tuple(value.shape)}, "
                f"expected {want}"
            )
    return i, j, values


def check_empty(root: Path, rewrite: bool = False) -> None:
    """Refuse a path for kernel tiles that exists and is not an empty directory (rewrite: or a
    directory of earlier tiles, which `_write_tiles` makes incomplete before writing anew)."""
    if not root.exists():
        return
    entries = {p.name for p in root.iterdir()} if root.is_dir() else None
    if entries is None or (entries and not (rewrite and entries <= _WRITTEN)):
        raise ValueError(
            f"path {root} exists and is not an empty directory"
            f"{' or earlier kernel tiles' if rewrite else ''}; kernel tiles need a new or empty "
            "directory"
        )


def _write_tiles(grid: Grid, mine: list, root: Path, summary: dict, progress: bool) -> None:
    """Every rank writes its tiles (atomically: a partial file never has the final name; a
    failed write names the file, `atomic_path`, and stops every rank, `together`); rank 0 writes
    the index once every tile is present (or stops every rank), and first deletes the tile files
    of an earlier kernel that this grid does not write (another tile size or symmetry)."""
    rank, _ = rank_and_world()
    folder = root / _TILES
    if rank == 0:  # earlier tiles being rewritten no longer look complete
        (root / _INDEX).unlink(missing_ok=True)
        make_directory(folder)
        written = {f"{i}_{j}.npz" for i, j in grid.tiles()}
        for file in folder.iterdir():
            if _TILE_FILE.fullmatch(file.name) and file.name not in written:
                file.unlink()
    barrier()
    with together(OSError):
        for i, j, values in grid.compute(mine, progress=progress):
            tile = folder / f"{i}_{j}.npz"
            with atomic_path(tile, temporary=f"{i}_{j}.part.npz") as part:
                arrays = {
                    f"c{c}": values[k].detach().cpu().numpy() for c, k in enumerate(grid.keys)
                }
                np.savez(part, **arrays)
    with together(RuntimeError, OSError):
        if rank == 0:
            missing = [t for t in grid.tiles() if not (folder / f"{t[0]}_{t[1]}.npz").exists()]
            if missing:
                raise RuntimeError(
                    f"{len(missing)} tiles missing under {folder} (e.g. {missing[0]}); "
                    "do all ranks share this filesystem?"
                )
            with atomic_path(root / _INDEX, temporary=_INDEX + ".part") as tmp:
                tmp.write_text(json.dumps({"format": TILES_FORMAT, **summary}, indent=1))
