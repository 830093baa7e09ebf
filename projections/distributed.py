"""Feature stores on torch.distributed: featurisation sharded over the ranks of a process group,
and projected kernels Φ Φᵀ of stores computed tile by tile by all ranks.

Sharded featurisation (`projections.featurize(..., distributed=True)`, the default inside an
initialised group of several processes) keeps the single-process store format:

1. rank 0 creates the store (or checks an existing one against the settings) and merges the
   journal left by an interrupted distributed run; all ranks check that they agree on the
   settings (model fingerprint, data size, kind, dim, seed, …);
2. the blocks not yet complete are cut into contiguous runs, one per rank
   (`ntk.distributed.shard`); each rank writes its blocks' rows into the shared `features.npy`
   and, once a block's rows are flushed, records its SHA-256 in `journal/<block>.sha256`
   (atomically) instead of in the manifest, which only rank 0 writes;
3. once every rank is done rank 0 checks every journal entry against the bytes it reads back,
   adds the blocks to the manifest in block order and removes the journal, then the ranks
   return; a failure of this step (blocks missing, a manifest that cannot be written) is raised
   on every rank (`ntk.distributed.together`), as is a failure of any rank's share in step 2.

The features and the manifest are byte-identical to a single-process run with the same settings
and `batch_size`. A rerun after a rank died (with any number of ranks) keeps the blocks that
were journalled and computes only the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch

from ntk.core.files import atomic_path, make_directory
from ntk.distributed import (
    agree,
    check_empty,
    rank_and_world,
    run_grid,
    shard,
    together,
)

from . import _format
from .projected import Featurizer, kernel_grid


def featurize_shard(
    fz: Featurizer, first, blocks, root: Path, settings: dict, batch_size, show: bool
):
    """This rank's share of `projections.featurize` (called by it with the store's settings;
    `first`: the data's first block, also the head of `blocks`)."""
    rank, world = rank_and_world()
    error, read_only = None, False
    with ExitStack() as lock:
        try:
            if rank == 0:
                if (root / _format.MANIFEST).exists():
                    read_only = _format.complete(
                        _format.matching(root, settings, batch_size, fz, first)
                    )
                if not read_only:
                    make_directory(root)
                    lock.enter_context(_format.writer_lock(root))
                    manifest = _format.load_or_create(root, settings, batch_size, fz, first)
                    _merge_journal(root, manifest)
                    (root / _format.JOURNAL).mkdir()
        except (ValueError, TypeError, OSError) as e:
            error = e
        agree({"settings": settings, "batch_size": batch_size}, error)
        with together(ValueError, TypeError, OSError):  # a rank that sees no manifest stops all
            manifest = _format.read_manifest(root)
        todo = [i for i in range(manifest["num_blocks"]) if str(i) not in manifest["blocks"]]
        mine = [todo[t] for t in shard(len(todo), rank, world)]

        def record(i: int, digests: dict) -> None:
            entry = root / _format.JOURNAL / f"{i}.sha256"
            with (
                atomic_path(entry, temporary=f"{i}.sha256.part", durable=True) as tmp,
                open(tmp, "w") as f,
            ):
                json.dump(digests, f)

        with together(ValueError, TypeError, OSError):
            _format.write_blocks(fz, blocks, root, manifest, mine, record, show and rank == 0)
        # rank 0's failure stops every rank; blocks missing after the ranks' writes are a failed
        # run (exit 1, as kernel tiles missing are), not bad input
        with together(ValueError, TypeError, OSError, RuntimeError):
            if rank == 0 and not read_only:
                _merge_journal(root, manifest)
                missing = manifest["num_blocks"] - len(manifest["blocks"])
                if missing:
                    raise RuntimeError(
                        f"{missing} blocks of the store at {root} are missing or do not hold the "
                        "bytes their rank wrote (do all ranks share this filesystem, with "
                        "coherent writes?); run again to recompute them"
                    )
    return _format.open_store(root, verify=False)


def _merge_journal(root: Path, manifest: dict) -> None:
    """Move the journalled blocks whose bytes match their digest into the manifest (in block
    order, as one process writes it) and delete the journal. Each entry was journalled only
    after its rank had matched every complete block against its data, so the merged blocks
    belong to the same data as the manifest's."""
    journal = root / _format.JOURNAL
    if not journal.is_dir():
        return
    array = _format.open_array(root, manifest)
    block = manifest["block"]
    for entry in journal.glob("*.sha256"):
        i = int(entry.name.split(".")[0])
        try:
            digests = json.loads(entry.read_text())
        except ValueError:
            continue  # not a complete entry: the block is computed again
        rows = array[i * block : (i + 1) * block]
        if isinstance(digests, dict) and _format.rows_digest(rows) == digests.get("features"):
            manifest["blocks"][str(i)] = digests
    manifest["blocks"] = {
        str(i): manifest["blocks"][str(i)] for i in sorted(map(int, manifest["blocks"]))
    }
    _format.check_manifest(manifest, root / _format.MANIFEST)
    _format.write_manifest(root, manifest)
    shutil.rmtree(journal)


def kernel(
    store1: str | os.PathLike,
    store2: None | str | os.PathLike = None,
    *,
    path: None | str | os.PathLike = None,
    rewrite: bool = False,
    out=None,
    tile: int = 4096,
    progress: bool = False,
):
    """Φ1 Φ2ᵀ of complete feature stores (store2=None: Φ1 Φ1ᵀ, symmetric) as the stores' kind,
    with its `tile` × `tile` tiles shared among the ranks (see `ntk.distributed`).

    path=None: gathered to rank 0, which returns a numpy array (or fills `out`), other ranks
    None; path: a new or empty directory (rewrite=True: or one holding the tiles of an earlier
    kernel, whose index is removed before any tile is written, so that an interrupted rewrite
    never looks complete) under which every rank writes its tiles (read with
    `ntk.distributed.load_tiles`); any other existing path is refused before any work. The
    numbers are those of `projections.kernel` (a symmetric kernel's lower tiles are mirrors of the
    upper ones).
    """
    rank = rank_and_world()[0]
    grid = error = None
    try:
        kind = _format.store_info(store1)["kind"]
        if store2 is not None and _format.store_info(store2)["kind"] != kind:
            raise ValueError(
                f"the stores hold features of different kinds ({kind} and "
                f"{_format.store_info(store2)['kind']})"
            )
        if path is not None and rank == 0:
            check_empty(Path(path), rewrite=rewrite)
        phi1 = _format.open_store(store1, verify=False)
        phi2 = None if store2 is None else _format.open_store(store2, verify=False)
        grid = kernel_grid(phi1, phi2, kind=kind, tile=tile)
    except (ValueError, TypeError) as e:
        error = e
    result = run_grid(grid, path=path, out=out, progress=progress, error=error)
    return result.numpy() if isinstance(result, torch.Tensor) else result
