"""Scaling over torch.distributed ranks: 1 vs 2 processes (torchrun, Gloo on CPU) for sharded
featurisation into a feature store and for a tiled trace eNTK, with one thread per process.

    python benchmarks/distributed_scaling.py               # launches torchrun, prints the table
    python benchmarks/distributed_scaling.py --quick       # a seconds-long smoke run

Workload (fixed seed, PyTorch default initialisation, float32, CPU): an MLP 64-512-512-10
(ReLU, 300k parameters) on N Gaussian inputs. Featurise: `projections.featurize`, trace kind,
k = --dim, blocks of --block samples, into a fresh store (the store's bytes are checked to be
identical across world sizes). Kernel: `ntk.distributed.empirical_ntk(kind="trace")` with tiles
of --tile samples, gathered to rank 0 (and the gathered kernel checked equal across world sizes).
Each configuration is one torchrun job that repeats each operation --repeats times between
barriers; times are the medians of rank 0's wall clock, excluding process start-up and imports.
A 1-process × 2-thread run is shown for reference: on a 2-core machine it competes for the same
cores as 2 processes × 1 thread.

    python benchmarks/distributed_scaling.py --backend nccl --procs 1   # on GPUs, one per rank

With --backend nccl each rank runs on cuda:LOCAL_RANK (`torch.cuda.set_device` first, as
`ntk.distributed` asks) and the table has one column per --procs entry; the digests are then
checked equal across those runs only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# (timed operation, table label, digest compared across configurations)
OPERATIONS = (
    ("featurize", "featurize (store)", "store"),
    ("kernel", "trace eNTK (tiles)", "kernel"),
)


def workload(n: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).eval()
    return model, torch.randn(n, 64, generator=torch.Generator().manual_seed(1))


def worker(args) -> None:
    """One rank of a torchrun job: time the operations, rank 0 writes the results as JSON."""
    import torch.distributed as dist

    import ntk.distributed
    import projections

    device = "cpu"
    if args.backend == "nccl":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x = workload(args.samples)
    model, x = model.to(device), x.to(device)
    times = {"featurize": [], "kernel": []}
    digests = {}
    for r in range(args.repeats):
        store = Path(args.workdir) / f"store-{world}-{r}"
        dist.barrier()
        start = time.perf_counter()
        projections.featurize(
            model,
            x,
            store,
            dim=args.dim,
            kind="trace",
            block=args.block,
            batch_size=args.block,
            device=device,
            progress=False,
        )
        dist.barrier()
        times["featurize"].append(time.perf_counter() - start)
        digests["store"] = hashlib.sha256((store / "features.npy").read_bytes()).hexdigest()
        start = time.perf_counter()
        k = ntk.distributed.empirical_ntk(
            model, x, kind="trace", batch_size=args.tile, device=device
        )
        if device != "cpu":
            torch.cuda.synchronize(device)
        dist.barrier()
        times["kernel"].append(time.perf_counter() - start)
        if rank == 0:
            digests["kernel"] = hashlib.sha256(k.cpu().numpy().tobytes()).hexdigest()
    if rank == 0:
        Path(args.result).write_text(json.dumps({"times": times, "digests": digests}))
    dist.destroy_process_group()


def launch(args, procs: int, threads: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as work:
        result = Path(work) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={procs}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            __file__,
            "--worker",
            "--workdir",
            work,
            "--result",
            str(result),
            "--samples",
            str(args.samples),
            "--dim",
            str(args.dim),
            "--block",
            str(args.block),
            "--tile",
            str(args.tile),
            "--repeats",
            str(args.repeats),
            "--backend",
            args.backend,
        ]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--tile", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--procs", default=None, help="nccl: comma list of process counts (GPUs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.samples, args.dim, args.block, args.tile, args.repeats = 256, 64, 64, 64, 1
    if args.backend == "nccl":
        return nccl_table(args)
    configs = [(1, 1), (2, 1), (1, 2)]
    runs = {c: launch(args, *c) for c in configs}
    same = {
        key: len({runs[c]["digests"][key] for c in configs}) == 1 for key in ("store", "kernel")
    }
    print(
        f"N = {args.samples}, MLP 64-512-512-10, k = {args.dim}, store blocks of {args.block}, "
        f"kernel tiles of {args.tile}; medians of {args.repeats} (seconds)"
    )
    print(
        f"{'operation':<22}{'1 proc x 1 thr':>16}{'2 procs x 1 thr':>17}{'speed-up':>10}"
        f"{'1 proc x 2 thr':>16}{'identical':>11}"
    )
    for op, label, key in OPERATIONS:
        t = {c: statistics.median(runs[c]["times"][op]) for c in configs}
        print(
            f"{label:<22}{t[(1, 1)]:>16.2f}{t[(2, 1)]:>17.2f}{t[(1, 1)] / t[(2, 1)]:>9.2f}x"
            f"{t[(1, 2)]:>16.2f}{'yes' if same[key] else 'NO':>11}"
        )


def nccl_table(args) -> None:
    """One torchrun job per entry of --procs (one GPU per rank), NCCL."""
    procs = [int(p) for p in (args.procs or "1").split(",")]
    runs = {p: launch(args, p, 1) for p in procs}
    print(
        f"NCCL, N = {args.samples}, MLP 64-512-512-10, k = {args.dim}, store blocks of "
        f"{args.block}, kernel tiles of {args.tile}; medians of {args.repeats} (seconds)"
    )
    compare = len(procs) > 1  # the digests are compared across process counts
    header = "".join(f"{f'{p} GPU(s)':>12}" for p in procs)
    print(f"{'operation':<22}{header}" + (f"{'identical':>11}" if compare else ""))
    for op, label, key in OPERATIONS:
        same = len({runs[p]["digests"][key] for p in procs}) == 1
        times = "".join(f"{statistics.median(runs[p]['times'][op]):>12.3f}" for p in procs)
        print(f"{label:<22}{times}" + (f"{'yes' if same else 'NO':>11}" if compare else ""))


if __name__ == "__main__":
    main()
