"""Distributed kernels and sharded featurisation under `torchrun --nproc_per_node=2` (Gloo on
CPU, loopback only), compared byte for byte with one process, including a featurisation whose
rank 1 dies mid-way and is resumed. The worker is tests/distributed_worker.py."""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from distributed_worker import BLOCK, TILE, cli_args, featurize, model_and_data

import ntk
import ntk.distributed
import projections

HERE = os.path.dirname(__file__)


def torchrun(out, mode):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--max_restarts=0",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            os.path.join(HERE, "distributed_worker.py"),
            str(out),
            mode,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two torchrun jobs: one whose rank 1 dies after its first block, then one that computes
    the kernels, a fresh store and resumes the killed one."""
    out = tmp_path_factory.mktemp("distributed")
    np.savez(out / "x.npz", x=model_and_data()[1].numpy())
    killed = torchrun(out, "kill")
    journal = sorted(p.name for p in (out / "resumed" / "journal").glob("*.sha256"))
    partial = projections.store_info(out / "resumed")
    done = torchrun(out, "all")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, killed, journal, partial


def same_bytes(a, b):
    return a.read_bytes() == b.read_bytes()


def test_gathered_kernels_equal_one_process(runs):
    out = runs[0]
    got = torch.load(out / "gathered.pt")
    model, x = model_and_data()
    assert torch.equal(got["full"], ntk.empirical_ntk(model, x, kind="full", batch_size=TILE))
    want = ntk.empirical_ntk(model, x, x[:9], kind="trace", layers="all", batch_size=TILE)
    assert list(got["layers"]) == list(want) == ["fc1", "fc2", "head"]
    assert all(torch.equal(got["layers"][k], want[k]) for k in want)


def test_kernel_tiles_on_disk_equal_one_process(runs):
    out = runs[0]
    model, x = model_and_data()
    want = ntk.empirical_ntk(model, x, kind="diagonal", batch_size=TILE)
    tiles = sorted(p.name for p in (out / "diagonal" / "tiles").iterdir())
    assert len(tiles) == 6 * 7 // 2  # 6 row blocks: j >= i only
    assert torch.equal(ntk.distributed.load_tiles(out / "diagonal"), want)
    into = np.lib.format.open_memmap(
        out / "k.npy", mode="w+", dtype="float32", shape=tuple(want.shape)
    )
    ntk.distributed.load_tiles(out / "diagonal", out=into)
    assert np.array_equal(into, want.numpy())


def test_sharded_store_equals_one_process_byte_for_byte(runs, tmp_path):
    out = runs[0]
    featurize(tmp_path / "single")
    for name in ("features.npy", "manifest.json"):
        assert same_bytes(out / "fresh" / name, tmp_path / "single" / name), name
    assert not (out / "fresh" / "journal").exists()
    assert np.array_equal(
        projections.open_store(out / "fresh"), projections.open_store(tmp_path / "single")
    )


def test_killed_rank_leaves_journal_and_the_rerun_completes_identically(runs, tmp_path):
    out, killed, journal, partial = runs
    assert killed.returncode != 0
    assert "2.sha256" in journal  # rank 1 owns blocks 2-4 and finished block 2
    assert partial["blocks"] == {}  # only rank 0 writes the manifest, at the end
    redone = [json.loads((out / f"resumed.{r}.json").read_text()) for r in range(2)]
    assert sorted(redone[0] + redone[1]) == [i for i in range(5) if f"{i}.sha256" not in journal]
    featurize(tmp_path / "single")
    for name in ("features.npy", "manifest.json"):
        assert same_bytes(out / "resumed" / name, tmp_path / "single" / name), name


def test_cli_on_one_process_writes_the_same_store_and_kernel_tiles(runs, tmp_path):
    out = runs[0]
    args = cli_args(tmp_path / "cli", out / "x.npz") + ["--kernel-tiles", str(tmp_path / "k")]
    run = subprocess.run(
        [sys.executable, "-m", "attribution.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": HERE},
    )
    assert run.returncode == 0, run.stderr
    row = json.loads(run.stdout)["rows"][0]
    assert (row["samples"], row["shape"], row["blocks"], row["ranks"]) == (23, "23x3x16", 5, 1)
    for name in ("features.npy", "manifest.json"):
        assert same_bytes(out / "resumed" / name, tmp_path / "cli" / name), name
    phi = projections.open_store(tmp_path / "cli")
    assert np.array_equal(
        ntk.distributed.load_tiles(tmp_path / "k").numpy(),
        projections.kernel(phi, kind="trace", tile=BLOCK),
    )


def test_store_kernels_equal_one_process(runs):
    out = runs[0]
    phi = projections.open_store(out / "fresh")
    got = torch.load(out / "gathered.pt")["phi_k"].numpy()
    assert np.array_equal(got, projections.kernel(phi, kind="trace", tile=TILE))
    assert np.array_equal(got, got.T)
    cross = ntk.distributed.load_tiles(out / "store_kernel").numpy()
    assert np.array_equal(
        cross,
        projections.kernel(phi, projections.open_store(out / "resumed"), kind="trace", tile=TILE),
    )
    model, x = model_and_data()
    assert np.allclose(
        got,
        projections.projected_ntk(model, x, dim=phi.shape[-1], seed=1).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_ranks_that_disagree_or_fail_raise_on_every_rank(runs):
    """A rank's failure was a RuntimeError on the others, its error a repr ("rank 0 failed:
    ValueError('path …')"), or, writing tiles or completing a store, Gloo's "Connection closed
    by peer"; it is RankFailed there, of the error's category, naming the rank and the error."""
    out = runs[0]
    errors = [json.loads((out / f"errors.{r}.json").read_text()) for r in range(2)]
    messages = [{case: e[0] for case, e in errors[r].items()} for r in range(2)]
    assert "rank 1 disagrees with rank 0 on n1" in messages[0]["samples"]
    assert "rank 0 disagrees with rank 1 on n1" in messages[1]["samples"]
    assert "disagrees" in messages[0]["seed"] and "settings" in messages[1]["seed"]
    path = messages[0]["path"].removeprefix("ValueError: ")
    assert path.startswith("path") and "not an empty directory" in path
    assert messages[1]["path"] == f"RankFailed: rank 0 failed: ValueError: {path}"
    nan = "data contains non-finite values (NaN or inf)"  # read by rank 1 only
    assert messages[1]["nan"] == f"ValueError: {nan}"
    assert messages[0]["nan"] == f"RankFailed: rank 1 failed: ValueError: {nan}"
    for case in ("path", "nan"):
        assert all("ValueError" in errors[r][case][1] for r in range(2)), case
    full = f"[Errno 28] No space left on device: '{out / 'full' / 'tiles' / '1_5.npz'}'"
    assert messages[1]["tiles"] == f"OSError: {full}"  # the first of rank 1's tiles
    assert messages[0]["tiles"] == f"RankFailed: rank 1 failed: OSError: {full}"
    assert all("OSError" in errors[r]["tiles"][1] for r in range(2))
    unshared = (
        f"11 tiles missing under {out / 'unshared' / 'tiles'} (e.g. (1, 5)); do all ranks share "
        "this filesystem?"
    )  # rank 0 checks that every tile is present
    assert messages[0]["unshared"] == f"RuntimeError: {unshared}"
    assert messages[1]["unshared"] == f"RankFailed: rank 0 failed: RuntimeError: {unshared}"
    unseen = (
        f"3 blocks of the store at {out / 'unseen'} are missing or do not hold the bytes their "
        "rank wrote (do all ranks share this filesystem, with coherent writes?); run again to "
        "recompute them"
    )  # rank 0, completing the store, finds rank 1's blocks missing
    assert messages[0]["unseen"] == f"RuntimeError: {unseen}"  # a failed run, not bad input
    assert messages[1]["unseen"] == f"RankFailed: rank 0 failed: RuntimeError: {unseen}"
    assert all("RuntimeError" in errors[r]["unseen"][1] for r in range(2))
    no_manifest = f"{out / 'no manifest' / 'elsewhere'} is not a feature store (no manifest.json)"
    assert messages[1]["no manifest"] == f"StoreError: {no_manifest}"  # rank 1 reads none
    assert messages[0]["no manifest"] == f"RankFailed: rank 1 failed: StoreError: {no_manifest}"


def test_cli_names_the_rank_that_failed_on_every_rank_with_its_exit_status(tmp_path):
    """`ntk featurize` under torchrun, one rank failing: the others printed "RuntimeError: rank 0
    failed: StoreError('…')" and exited 1 where that rank exited 2, or, when its --kernel-tiles
    could not be written, Gloo's "Connection closed by peer". The failing rank's own line did
    not name its rank; it starts "rank N: "."""
    np.savez(tmp_path / "x.npz", x=model_and_data()[1].numpy())
    featurize(tmp_path / "store")
    run = torchrun(tmp_path, "cli")
    assert run.returncode == 0, run.stderr[-3000:]
    said = [json.loads((tmp_path / f"cli.{r}.json").read_text()) for r in range(2)]
    said = [{case: (r["code"], r["err"].splitlines()[-1]) for case, r in s.items()} for s in said]
    settings = (
        f"the store at {tmp_path / 'store'} was written with other settings (seed: store has "
        "1, requested 2); use another path"
    )
    assert said[0]["seed"] == (2, f"ntk: error: rank 0: {settings}")
    assert said[1]["seed"] == (2, f"ntk: error: rank 0 failed: StoreError: {settings}")
    full = tmp_path / "full"  # rank 1's --kernel-tiles, on a full disk
    assert said[1]["tiles"] == (
        1,
        f"ntk: error: rank 1: --kernel-tiles {full}: cannot write: No space left on device",
    )
    assert said[0]["tiles"] == (
        1,
        "ntk: error: rank 1 failed: OSError: [Errno 28] No space left on device: "
        f"'{full / 'tiles' / '1_3.npz'}'",
    )


def test_kernel_tiles_that_are_missing_damaged_or_misshapen_are_named(tmp_path):
    """load_tiles of a file, a missing tile, a damaged or misshapen one failed with raw
    NotADirectoryError, FileNotFoundError, numpy's pickle advice or a broadcast error."""
    model, x = model_and_data()
    ntk.distributed.empirical_ntk(model, x[:8], kind="trace", batch_size=4, path=tmp_path / "t")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file, not the directory of kernel tiles"):
        ntk.distributed.load_tiles(tmp_path / "file")
    tile = tmp_path / "t" / "tiles" / "0_1.npz"
    cases = [
        (lambda: tile.unlink(), "is missing"),
        (lambda: tile.write_bytes(b"junk"), "is damaged: not the .npz of arrays"),
        (lambda: np.savez(tile, c0=np.zeros((2, 2))), "has shape \\(2, 2\\), expected \\(4, 4\\)"),
    ]
    for damage, message in cases:
        damage()
        with pytest.raises(ValueError, match=f"^tile {re.escape(str(tile))} .*{message}"):
            ntk.distributed.load_tiles(tmp_path / "t")
        with pytest.raises(ValueError, match=f"{message}.*; out holds only the tiles before this"):
            ntk.distributed.load_tiles(tmp_path / "t", out=np.zeros((8, 8)))


def test_single_process_fallback_and_errors(tmp_path):
    model, x = model_and_data()
    assert ntk.distributed.rank_and_world() == (0, 1)
    assert [len(ntk.distributed.shard(10, r, 3)) for r in range(3)] == [3, 3, 4]
    assert list(ntk.distributed.shard(5, 1, 2)) == [2, 3, 4]
    k = ntk.distributed.empirical_ntk(model, x, kind="trace", batch_size=TILE)
    assert torch.equal(k, ntk.empirical_ntk(model, x, kind="trace", batch_size=TILE))
    ntk.distributed.empirical_ntk(
        model, x, x[:5], kind="sum_logits", batch_size=TILE, path=tmp_path / "t"
    )
    assert torch.equal(
        ntk.distributed.load_tiles(tmp_path / "t"),
        ntk.empirical_ntk(model, x, x[:5], kind="sum_logits", batch_size=TILE),
    )
    with pytest.raises(ValueError, match="not an empty directory"):
        ntk.distributed.empirical_ntk(model, x, kind="trace", path=tmp_path / "t")
    with pytest.raises(ValueError, match="not both"):
        ntk.distributed.empirical_ntk(
            model, x, kind="trace", path=tmp_path / "u", out=torch.empty(23, 23)
        )
    # the refused call left nothing; the path was asked whether its job had been interrupted
    with pytest.raises(ValueError, match="u does not exist"):
        ntk.distributed.load_tiles(tmp_path / "u")
    with pytest.raises(ValueError, match="unknown method"):
        ntk.distributed.empirical_ntk(model, x, method="bogus")
