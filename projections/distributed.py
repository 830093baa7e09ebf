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
3. after a barrier rank 0 checks every journal entry against the bytes it reads back, adds the
   blocks to the manifest in block order and removes the journal, then the ranks return.

The features and the manifest are byte-identical to a single-process run with the same settings
and `batch_size`. A rerun after a rank died (with any number of ranks) keeps the blocks that
were journalled and computes only the rest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ntk.distributed import agree, barrier, rank_and_world, run_grid, shard

from . import store
from .projected import Featurizer, kernel_grid

_JOURNAL = "journal"


def featurize_shard(fz: Featurizer, blocks, root: Path, settings: dict, batch_size, show: bool):
    """This rank's share of `projections.featurize` (called by it with the store's settings)."""
    rank, world = rank_and_world()
    error = None
    try:
        if rank == 0:
            manifest = store._load_or_create(root, settings, batch_size, fz, settings["samples"])
            _merge_journal(root, manifest)
            (root / _JOURNAL).mkdir()
    except (ValueError, TypeError, OSError) as e:
        error = e
    agree({"settings": settings, "batch_size": batch_size}, error)
    manifest = store.store_info(root)
    todo = [i for i in range(manifest["num_blocks"]) if str(i) not in manifest["blocks"]]
    mine = [todo[t] for t in shard(len(todo), rank, world)]

    def record(i: int, digest: str) -> None:
        tmp = root / _JOURNAL / f"{i}.sha256.part"
        with open(tmp, "w") as f:
            f.write(digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / _JOURNAL / f"{i}.sha256")

    store.write_blocks(fz, blocks, root, manifest, mine, record, show and rank == 0)
    barrier()
    if rank == 0:
        _merge_journal(root, manifest)
        missing = manifest["num_blocks"] - len(manifest["blocks"])
        if missing:
            raise store.StoreError(
                f"{missing} blocks of the store at {root} are missing or do "
                "not hold the bytes their rank wrote (do all ranks share this "
                "filesystem, with coherent writes?); run again to recompute them"
            )
    barrier()
    return store.open_store(root, verify=False)


def _merge_journal(root: Path, manifest: dict) -> None:
    """Move the journalled blocks whose bytes match their digest into the manifest (in block
    order, as one process writes it) and delete the journal."""
    journal = root / _JOURNAL
    if not journal.is_dir():
        return
    array = store._open_array(root, manifest)
    block = manifest["block"]
    for entry in journal.glob("*.sha256"):
        i = int(entry.name.split(".")[0])
        digest = entry.read_text()
        if store._digest(array[i * block : (i + 1) * block]) == digest:
            manifest["blocks"][str(i)] = digest
    manifest["blocks"] = {
        str(i): manifest["blocks"][str(i)] for i in sorted(map(int, manifest["blocks"]))
    }
    store._write_manifest(root, manifest)
    shutil.rmtree(journal)


def kernel(
    store1: str | os.PathLike,
    store2: None | str | os.PathLike = None,
    *,
    path: None | str | os.PathLike = None,
    out=None,
    tile: int = 4096,
    progress: bool = False,
):
    """Φ1 Φ2ᵀ of complete feature stores (store2=None: Φ1 Φ1ᵀ, symmetric) as the stores' kind,
    with its `tile` × `tile` tiles shared among the ranks (see `ntk.distributed`).

    path=None: gathered to rank 0, which returns a numpy array (or fills `out`), other ranks
    None; path: every rank writes its tiles under that directory (read with
    `ntk.distributed.load_tiles`). The numbers are those of `projections.kernel` (a symmetric
    kernel's lower tiles are mirrors of the upper ones).
    """
    kind = store.store_info(store1)["kind"]
    if store2 is not None and store.store_info(store2)["kind"] != kind:
        raise ValueError(
            f"the stores hold features of different kinds ({kind} and "
            f"{store.store_info(store2)['kind']})"
        )
    phi1 = store.open_store(store1, verify=False)
    phi2 = None if store2 is None else store.open_store(store2, verify=False)
    result = run_grid(
        kernel_grid(phi1, phi2, kind=kind, tile=tile), path=path, out=out, progress=progress
    )
    return result.numpy() if isinstance(result, torch.Tensor) else result
