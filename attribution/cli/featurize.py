"""`ntk featurize`: stream projected Jacobian features into an on-disk store, on one process or
sharded over the ranks of a torchrun job
(``torchrun --nproc_per_node=K $(which ntk) featurize …``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from .choices import DEFAULT_PROJECTOR, KERNEL_KINDS, PROJECTORS
from .common import (
    UsageProblem,
    check_paths,
    emit,
    flag_names,
    interactive,
    load_output_fn,
    model_files,
    model_options,
    resolve_model_and_data,
    step,
    untrained_note,
    writing_into,
)

COLUMNS = ("store", "samples", "shape", "blocks", "ranks", "seconds", "kernel_tiles")


@click.command()
@click.argument("store", default="ntk-features")
@model_options(COLUMNS)
@click.option(
    "--dim",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="projection dimension k",
)
@click.option("--kind", type=click.Choice(KERNEL_KINDS), default="trace", show_default=True)
@click.option(
    "--projector",
    type=click.Choice(PROJECTORS),
    default=DEFAULT_PROJECTOR,
    show_default=True,
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--block",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="samples per store block (the unit of resuming and of sharding over ranks)",
)
@click.option(
    "--store-dtype",
    type=click.Choice(["float16", "float32", "float64"]),
    default="float32",
    show_default=True,
)
@click.option(
    "--kernel-tiles",
    default=None,
    help="also write the projected kernel Φ Φᵀ as tiles into this new or empty directory (or "
    "rewrite the tiles an earlier run wrote there)",
)
def featurize(
    store,
    model_spec,
    weights,
    data,
    samples,
    device,
    output_fn,
    batch_size,
    out,
    dim,
    kind,
    projector,
    seed,
    block,
    store_dtype,
    kernel_tiles,
):
    """Featurise the data (default: all of it) into the directory STORE (default: ./ntk-features),
    resuming an interrupted run.

    Under torchrun (WORLD_SIZE > 1) every rank joins the job's process group (NCCL with a CUDA
    --device, each rank on cuda:LOCAL_RANK; Gloo otherwise), writes its share of the blocks into
    the shared STORE, and rank 0 completes the manifest and prints the summary."""
    import torch.distributed as dist

    import projections
    import projections.distributed
    import projections.store
    from ntk.distributed import check_empty, rank_and_world

    # a complete store is only read: it may sit in a read-only directory
    store_is_read = projections.store.is_complete(store)
    check_paths(
        [("--output", out.path)],
        model_files(model_spec, weights, data, output_fn=output_fn)
        + [("STORE", store if store_is_read else None)],
        [("STORE", None if store_is_read else store), ("--kernel-tiles", kernel_tiles)],
    )
    try:
        projections.store.check_not_foreign(store)
    except projections.store.StoreError as exc:
        raise UsageProblem(f"STORE: {exc}") from None
    if kernel_tiles is not None:
        try:
            check_empty(Path(kernel_tiles), rewrite=True)  # the same line reruns
        except ValueError as exc:
            raise UsageProblem(f"--kernel-tiles: {exc}") from None
    device, joined = _join_process_group(device)
    rank, world = rank_and_world()
    model, x, _ = resolve_model_and_data(
        model_spec, weights, data, samples, device, default_samples=None, labels=False
    )
    untrained = untrained_note(model_spec, weights)
    start = time.perf_counter()
    # only the store's writes: their OSErrors name its files
    with writing_into("STORE", store), flag_names(data="--data"):
        phi = projections.featurize(
            model,
            x,
            store,
            dim=dim,
            kind=kind,
            projector=projector,
            seed=seed,
            block=block,
            batch_size=batch_size,
            device=device,
            store_dtype=store_dtype,
            output_fn=load_output_fn(output_fn),
            progress=interactive() and rank == 0,
        )
    seconds = time.perf_counter() - start
    if kernel_tiles is not None:
        with step("projected kernel tiles"), writing_into("--kernel-tiles", kernel_tiles):
            projections.distributed.kernel(store, path=kernel_tiles, rewrite=True, tile=block)
    if joined:
        dist.destroy_process_group()
    if rank == 0:
        info = projections.store_info(store)
        emit(
            [
                {
                    "store": str(store),
                    "samples": info["samples"],
                    "shape": "x".join(map(str, phi.shape)),
                    "blocks": info["num_blocks"],
                    "ranks": world,
                    "seconds": round(seconds, 3),
                    "kernel_tiles": kernel_tiles or "",
                }
            ],
            out,
            columns=COLUMNS[:-1],
            title=f"feature store ({info['samples']} samples)",
            untrained=untrained,
        )


def _join_process_group(device):
    """Inside a torchrun job, initialise its process group unless the caller did; returns this
    rank's device and whether the group was initialised here."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device, False
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo")
    return device, True
