"""Run under torchrun by tests/test_distributed.py: distributed kernels and sharded featurisation
of a tiny model, written under OUT for the test to compare with one process.

usage: distributed_worker.py OUT kill|all|cli
  kill: `ntk featurize OUT/resumed` of OUT/x.npz, rank 1 dies (os._exit) after its first block
  all:  kernels (gathered and as tiles), featurise OUT/fresh, resume OUT/resumed, store kernels
  cli:  `ntk featurize` runs that fail on one rank only (OUT/store: featurised by one process
        beforehand); each rank writes its exit status and stderr to OUT/cli.RANK.json
"""

import contextlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist
from dying import die_after_records
from models import MLP
from torch.utils.data import DataLoader, TensorDataset

import ntk.distributed
import projections
import projections._format
import projections.distributed
from attribution.cli.main import cli
from attribution.cli.main import main as main_cli

N, DIM, BLOCK, TILE = 23, 16, 5, 4


def model_and_data():
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(7))
    return model, x


def tiny_model():
    """The model as a factory for `ntk featurize --model`."""
    return model_and_data()[0]


def cli_args(store, data):
    """`ntk featurize` arguments with the settings of `featurize`."""
    return [
        "featurize",
        str(store),
        "--model",
        f"{os.path.abspath(__file__)}:tiny_model",
        "--data",
        str(data),
        "--dim",
        str(DIM),
        "--kind",
        "trace",
        "--block",
        str(BLOCK),
        "--seed",
        "1",
        "--batch-size",
        "2",
        "--format",
        "json",
    ]


def featurize(path, log=None):
    """Featurise into `path`; `log`: also write the blocks this rank computes to that file."""
    model, x = model_and_data()
    write_blocks = projections._format.write_blocks

    def spy(fz, blocks, root, manifest, todo, *rest):
        with open(log, "w") as f:
            json.dump(list(todo), f)
        return write_blocks(fz, blocks, root, manifest, todo, *rest)

    if log is not None:
        projections._format.write_blocks = spy
    try:
        return projections.featurize(
            model, x, path, dim=DIM, kind="trace", block=BLOCK, seed=1, batch_size=2, progress=False
        )
    finally:
        projections._format.write_blocks = write_blocks  # later featurisations are not logged


def unseen_journal(path):
    """`featurize(path)` where rank 0, completing the store, does not see the journal entries of
    rank 1's blocks (2-4), as if rank 1 had written them on a filesystem of its own."""
    merge = projections.distributed._merge_journal

    def blind(root, manifest):
        for entry in (root / projections._format.JOURNAL).glob("*.sha256"):
            if int(entry.name.split(".")[0]) >= 2:
                entry.unlink()
        return merge(root, manifest)

    projections.distributed._merge_journal = blind
    try:
        return featurize(path)
    finally:
        projections.distributed._merge_journal = merge


def manifest_unseen(path):
    """`featurize(path)` where rank 1 does not see the manifest rank 0 made, as if the store were
    on a filesystem of rank 0's own."""
    read = projections._format.read_manifest

    def blind(root):
        if dist.get_rank() == 1:
            return read(root / "elsewhere")
        return read(root)

    projections._format.read_manifest = blind
    try:
        return featurize(path)
    finally:
        projections._format.read_manifest = read


def own_tiles(path, full=False):
    """`path`, a directory for kernel tiles that only this rank sees (its tiles folder made, as
    rank 0 makes the shared one); full: on a full disk, each tile's temporary file a link to
    /dev/full (the tiles of up to 6 x 6 blocks)."""
    os.makedirs(os.path.join(path, "tiles"))
    for i in range(6 if full else 0):
        for j in range(6):
            os.symlink("/dev/full", os.path.join(path, "tiles", f"{i}_{j}.part.npz"))
    return path


def run_cli(args) -> dict:
    """`ntk ARGS` as the console entry point runs it: its exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main_cli(args)
        except SystemExit as e:
            return {"code": e.code, "err": err.getvalue()}


def main(out, mode):
    rank = int(os.environ["RANK"])
    if mode == "cli":
        args = cli_args(os.path.join(out, "store"), os.path.join(out, "x.npz"))
        said = {"seed": run_cli([*args, "--seed", "2"])}  # refused by rank 0, which checks it
        tiles = own_tiles(os.path.join(out, "full"), full=True) if rank else os.path.join(out, "k")
        said["tiles"] = run_cli([*args, "--kernel-tiles", tiles])  # rank 1's disk is full
        with open(os.path.join(out, f"cli.{rank}.json"), "w") as f:
            json.dump(said, f)
        dist.destroy_process_group()  # the failed runs leave the group they joined
        return
    if mode == "kill":
        if rank == 1:
            die_after_records(1)
        cli.main(
            cli_args(os.path.join(out, "resumed"), os.path.join(out, "x.npz")),
            standalone_mode=False,
        )
        return
    dist.init_process_group("gloo")
    model, x = model_and_data()
    full = ntk.distributed.empirical_ntk(model, x, kind="full", batch_size=TILE)
    layers = ntk.distributed.empirical_ntk(
        model, x, x[:9], kind="trace", layers="all", batch_size=TILE
    )
    ntk.distributed.empirical_ntk(
        model, x, kind="diagonal", batch_size=TILE, path=os.path.join(out, "diagonal")
    )
    featurize(os.path.join(out, "fresh"))
    featurize(os.path.join(out, "resumed"), log=os.path.join(out, f"resumed.{rank}.json"))
    store = os.path.join(out, "fresh")
    phi_k = projections.distributed.kernel(store, tile=TILE)
    projections.distributed.kernel(
        store, os.path.join(out, "resumed"), tile=TILE, path=os.path.join(out, "store_kernel")
    )
    nan = x.clone()
    nan[-1] = float("nan")  # in the last block, which only rank 1 reads from a DataLoader
    errors = {}  # each rank's error when the ranks disagree or one fails
    for case, call in [
        ("samples", lambda: ntk.distributed.empirical_ntk(model, x[: 10 + rank], kind="trace")),
        (
            "seed",
            lambda: projections.featurize(
                model,
                x,
                os.path.join(out, "seeds"),
                dim=DIM,
                seed=rank,
                block=BLOCK,
                progress=False,
            ),
        ),
        (
            "path",
            lambda: ntk.distributed.empirical_ntk(
                model, x, kind="trace", path=os.path.join(out, "fresh")
            ),
        ),
        (
            "nan",
            lambda: projections.featurize(
                model,
                DataLoader(TensorDataset(nan), batch_size=BLOCK),
                os.path.join(out, "nan"),
                dim=DIM,
                block=BLOCK,
                progress=False,
            ),
        ),
        (
            "tiles",  # rank 1's disk is full (its path is another, as if not shared)
            lambda: ntk.distributed.empirical_ntk(
                model,
                x,
                kind="trace",
                batch_size=TILE,
                path=own_tiles(os.path.join(out, "full"), True)
                if rank
                else os.path.join(out, "tiles"),
            ),
        ),
        (
            "unshared",  # rank 1 writes its tiles where rank 0 does not see them
            lambda: ntk.distributed.empirical_ntk(
                model,
                x,
                kind="trace",
                batch_size=TILE,
                path=own_tiles(os.path.join(out, "own")) if rank else os.path.join(out, "unshared"),
            ),
        ),
        ("unseen", lambda: unseen_journal(os.path.join(out, "unseen"))),  # rank 0 completes it
        ("no manifest", lambda: manifest_unseen(os.path.join(out, "no manifest"))),
    ]:
        try:
            call()
        except Exception as e:  # its message and the built-in classes it is an instance of
            builtin = [c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"]
            errors[case] = [f"{type(e).__name__}: {e}", builtin]
    with open(os.path.join(out, f"errors.{rank}.json"), "w") as f:
        json.dump(errors, f)
    if rank == 0:
        torch.save(
            {"full": full, "layers": layers, "phi_k": torch.from_numpy(phi_k)},
            os.path.join(out, "gathered.pt"),
        )
    else:
        assert full is None and layers is None and phi_k is None
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
