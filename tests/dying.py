"""Writers that die mid-way (os._exit, as a killed process: no cleanup, no exception), for the
store tests; the library has no hook for this.

As a script: ``python dying.py PATH DATA_SEED MODEL_SEED HOW COUNT`` featurises the tiny store of
`featurize` into PATH and exits with status 3 when
  HOW = records: its COUNT-th new block has been recorded as complete;
  HOW = forward: the model starts its COUNT-th forward pass while the store's lock is held
    (mid-block, rows half written; the planning passes before the lock are not counted, so the
    count does not move when the library plans with more or fewer passes);
  HOW = manifest: its COUNT-th manifest is written to its temporary file, not yet renamed.
It exits 0 if the run finishes first, and 1 with the error's type and message on stderr when
featurize refuses.
"""

import os
import sys

import torch
from models import MLP

import projections
import projections._format

N, DIM, BLOCK, BATCH = 23, 16, 5, 2  # 5 blocks, the last one short


def model(seed: int = 0):
    torch.manual_seed(seed)
    return MLP().eval()


def data(seed: int = 7):
    return torch.randn(N, 5, generator=torch.Generator().manual_seed(seed))


def featurize(path, data_seed: int = 7, model_seed: int = 0, net=None):
    """The tiny store (net: a model to use instead of model(model_seed))."""
    return projections.featurize(
        model(model_seed) if net is None else net,
        data(data_seed),
        path,
        dim=DIM,
        kind="trace",
        block=BLOCK,
        seed=1,
        batch_size=BATCH,
        progress=False,
    )


def die_after_records(count: int) -> None:
    """Exit (status 3) right after this process has recorded `count` blocks as complete, in the
    manifest or in a distributed run's journal."""
    write_blocks = projections._format.write_blocks
    recorded = [0]

    def dying(fz, blocks, root, manifest, todo, record, show):
        def record_then_die(i, digests):
            record(i, digests)
            recorded[0] += 1
            if recorded[0] >= count:
                os._exit(3)

        return write_blocks(fz, blocks, root, manifest, todo, record_then_die, show)

    projections._format.write_blocks = dying


def die_at_forward(net: torch.nn.Module, count: int, path) -> None:
    """Exit (status 3) when `net` starts its `count`-th forward pass with the lock of the store
    at `path` held."""
    calls = [0]

    def hook(module, args):
        calls[0] += os.path.exists(os.path.join(path, "lock"))
        if calls[0] >= count:
            os._exit(3)

    net.register_forward_pre_hook(hook)


def die_in_manifest_write(count: int) -> None:
    """Exit (status 3) when the `count`-th manifest is about to be renamed over the old one: its
    temporary file is complete and left behind."""
    replace = os.replace
    writes = [0]

    def dying(src, dst):
        if os.path.basename(dst) == "manifest.json":
            writes[0] += 1
            if writes[0] >= count:
                os._exit(3)
        replace(src, dst)

    os.replace = dying


def main(path, data_seed, model_seed, how, count):
    net = model(int(model_seed))
    if how == "records":
        die_after_records(int(count))
    elif how == "manifest":
        die_in_manifest_write(int(count))
    else:
        die_at_forward(net, int(count), path)
    try:
        featurize(path, int(data_seed), net=net)
    except ValueError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
