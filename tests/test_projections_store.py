"""The on-disk feature store: contents, resume after a killed run (byte-identical), and refusal
of mismatched settings, other models, incomplete, truncated and corrupted stores."""

import json
import os
import re
import subprocess
import sys

import dying
import numpy as np
import pytest
import torch
from models import MLP
from torch.utils.data import DataLoader, TensorDataset

import ntk.distributed
import projections
import projections.distributed

N, DIM, BLOCK = 23, 32, 5  # 5 blocks, the last one short
HERE = os.path.dirname(__file__)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = MLP().eval()
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(7))
    return model, x


def store(path, model, x, **kw):
    return projections.featurize(
        model,
        x,
        path,
        dim=DIM,
        kind="trace",
        block=BLOCK,
        seed=1,
        batch_size=2,
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("projector", ["rademacher", "srht"])
def test_store_holds_the_features_and_its_kernel(tmp_path, projector):
    model, x = model_and_data()
    phi = store(tmp_path / "s", model, x, projector=projector)
    assert isinstance(phi, np.memmap) and not phi.flags.writeable and phi.shape == (N, 3, DIM)
    want = projections.features(model, x, dim=DIM, kind="trace", seed=1, projector=projector)
    assert np.allclose(phi, want.numpy(), rtol=1e-6, atol=1e-6)
    out = np.lib.format.open_memmap(tmp_path / "k.npy", mode="w+", dtype="float64", shape=(N, N))
    projections.kernel(projections.open_store(tmp_path / "s"), kind="trace", out=out, tile=7)
    exact = projections.projected_ntk(model, x, dim=DIM, seed=1, projector=projector)
    assert np.allclose(out, exact.numpy(), rtol=1e-5)
    info = projections.store_info(tmp_path / "s")
    assert (info["kind"], info["dim"], info["seed"], info["samples"], info["num_blocks"]) == (
        "trace",
        DIM,
        1,
        N,
        5,
    )
    assert sorted(info["blocks"]) == ["0", "1", "2", "3", "4"]


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate (macOS)")
def test_the_feature_array_reserves_its_disk_space_when_created(tmp_path):
    """features.npy was a sparse file: a disk filling up while blocks were written through the
    memory map killed the process with SIGBUS and no message. Its blocks are allocated when it
    is created, so a disk too small fails there, with "No space left on device"."""
    from projections import _format

    _format.create_array(tmp_path, {"store_dtype": "float32", "shape": [1000, 256]})
    held = os.stat(tmp_path / _format.ARRAY)
    assert held.st_blocks * 512 >= held.st_size >= 1000 * 256 * 4
    assert not [p.name for p in tmp_path.iterdir() if p.name != _format.ARRAY]


def test_data_sources_give_the_same_bytes(tmp_path):
    model, x = model_and_data()
    ref = store(tmp_path / "tensor", model, x)
    labelled = TensorDataset(x, torch.zeros(N))
    assert np.array_equal(store(tmp_path / "dataset", model, labelled), ref)
    loader = DataLoader(labelled, batch_size=3)  # batches straddle blocks
    assert np.array_equal(store(tmp_path / "loader", model, loader), ref)
    with pytest.raises(ValueError, match="shuffle"):
        store(tmp_path / "shuffled", model, DataLoader(labelled, shuffle=True))


def run_dying(path, *args):
    """tests/dying.py: featurise its tiny store into `path` in a subprocess that dies mid-way."""
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "dying.py"), str(path), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_killed_run_resumes_to_identical_bytes(tmp_path):
    """A subprocess dies (os._exit) after two blocks; the resumed store equals an
    uninterrupted one byte for byte (also across processes)."""
    run = run_dying(tmp_path / "resumed", 7, 0, "records", 2)
    assert run.returncode == 3, run.stderr
    partial = projections.store_info(tmp_path / "resumed")
    assert sorted(partial["blocks"]) == ["0", "1"]
    with pytest.raises(projections.StoreError, match="incomplete"):
        projections.open_store(tmp_path / "resumed")
    resumed = dying.featurize(tmp_path / "resumed")
    whole = dying.featurize(tmp_path / "whole")
    assert (tmp_path / "resumed" / "features.npy").read_bytes() == (
        tmp_path / "whole" / "features.npy"
    ).read_bytes()
    assert np.array_equal(resumed, whole)


def test_resumed_run_leaves_no_temporary_files(tmp_path):
    """A writer killed while writing its manifest leaves its temporary file; the run that resumes
    the store deletes it, and the finished store holds only the format's own files."""
    path = tmp_path / "s"
    run = run_dying(path, 7, 0, "manifest", 3)  # the store created, block 0 recorded
    assert run.returncode == 3, run.stderr
    assert sorted(projections.store_info(path)["blocks"]) == ["0"]
    assert len(list(path.glob("manifest.json.*.tmp"))) == 1
    resumed = dying.featurize(path)
    assert sorted(p.name for p in path.iterdir()) == ["features.npy", "lock", "manifest.json"]
    assert np.array_equal(resumed, dying.featurize(tmp_path / "whole"))


def test_half_written_block_is_recomputed(tmp_path):
    model, x = model_and_data()
    path = tmp_path / "s"
    store(path, model, x)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["blocks"]["3"]  # as if killed while writing 3
    (path / "manifest.json").write_text(json.dumps(manifest))
    arr = np.load(path / "features.npy", mmap_mode="r+")
    arr[3 * BLOCK : 4 * BLOCK] = 0.0
    arr.flush()
    del arr
    good = store(tmp_path / "good", model, x)
    assert np.array_equal(store(path, model, x), good)


def test_mismatched_settings_and_models_are_refused(tmp_path):
    model, x = model_and_data()
    path = tmp_path / "s"
    store(path, model, x)
    with pytest.raises(projections.StoreError, match="seed"):
        projections.featurize(model, x, path, dim=DIM, kind="trace", block=BLOCK, seed=2)
    with pytest.raises(projections.StoreError, match="kind"):
        projections.featurize(model, x, path, dim=DIM, kind="sum_logits", block=BLOCK, seed=1)
    with pytest.raises(projections.StoreError, match="samples"):
        store(path, model, x[:-1])
    other, _ = model_and_data(seed=1)
    with pytest.raises(projections.StoreError, match="different model"):
        store(path, other, x)
    # a complete store "is being written" was said to a rerun with another batch_size
    with pytest.raises(
        projections.StoreError, match="was written with batch_size=.*featurize into"
    ):
        projections.featurize(
            model, x, path, dim=DIM, kind="trace", block=BLOCK, seed=1, batch_size=BLOCK - 1
        )
    with torch.no_grad():
        model.fc1.bias[0] += 1e-3  # a trained step later
    with pytest.raises(projections.StoreError, match="different model"):
        store(path, model, x)


class _Swapped(MLP):
    """MLP's parameters, another forward pass (its two activations swapped)."""

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class _FailsAt(torch.utils.data.Dataset):
    def __init__(self, x, at):
        self.x, self.at = x, at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i >= self.at:
            raise OSError("the disk went away")
        return self.x[i]


def test_a_model_with_the_same_parameters_and_another_forward_pass_is_refused(tmp_path):
    """The model fingerprint hashes tensors only: a model with the same parameters and another
    forward pass (or output_fn) read a complete store's features as its own, and resumed an
    interrupted one, mixing two models' features in one store. The first sample's features are
    recomputed and compared."""
    model, x = model_and_data()
    swapped = _Swapped().eval()
    swapped.load_state_dict(model.state_dict())
    store(tmp_path / "complete", model, x)
    for other, options in ((swapped, {}), (model, {"output_fn": lambda out: 2 * out})):
        with pytest.raises(projections.StoreError, match="features of its first sample that"):
            store(tmp_path / "complete", other, x, **options)
    np.testing.assert_array_equal(
        store(tmp_path / "complete", model, x), store(tmp_path / "again", model, x)
    )
    half = tmp_path / "half"
    with pytest.raises(OSError, match="went away"):
        store(half, model, DataLoader(_FailsAt(x, BLOCK + 2), batch_size=2))
    assert sorted(projections.store_info(half)["blocks"]) == ["0"]
    with pytest.raises(projections.StoreError, match="features of its first sample that"):
        store(half, swapped, x)
    assert sorted(projections.store_info(half)["blocks"]) == ["0"]  # nothing of it written
    np.testing.assert_array_equal(store(half, model, x), store(tmp_path / "again", model, x))


def test_a_path_that_is_a_file_or_no_path_is_refused_naming_path(tmp_path):
    """featurize into an existing file failed with a raw FileExistsError, open_store(None) with
    a TypeError from pathlib."""
    model, x = model_and_data()
    (tmp_path / "file").write_text("x")
    message = f"path {tmp_path / 'file'} is a file, not the directory of a feature store"
    for call in (
        lambda: store(tmp_path / "file", model, x),
        lambda: projections.open_store(tmp_path / "file"),
        lambda: projections.store_info(tmp_path / "file"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    with pytest.raises(TypeError, match="path must be a str or os.PathLike .* got NoneType"):
        projections.open_store(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_labelled_kind_is_refused_before_anything_is_written(tmp_path):
    """featurize takes no labels: kind='lpntk' is refused naming kind (it failed asking for a
    labels= featurize lacks, after creating the store)."""
    model = MLP().eval()
    with pytest.raises(ValueError, match="kind='lpntk' needs labels, which a feature store"):
        projections.featurize(model, torch.randn(6, 5), tmp_path / "store", dim=4, kind="lpntk")
    assert not (tmp_path / "store").exists()


def test_corrupted_and_truncated_stores_are_refused(tmp_path):
    model, x = model_and_data()
    path = tmp_path / "s"
    store(path, model, x)
    file = path / "features.npy"
    raw = bytearray(file.read_bytes())
    raw[-(2 * 3 * DIM * 4) + 5] ^= 0xFF  # one byte of the last block
    file.write_bytes(bytes(raw))
    with pytest.raises(projections.StoreError, match="block 4 .* corrupted"):
        projections.open_store(path)
    with pytest.raises(projections.StoreError, match="corrupted"):
        store(path, model, x)  # resume refuses too
    file.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(projections.StoreError, match="truncated"):
        projections.open_store(path)
    with pytest.raises(projections.StoreError, match="not a feature store"):
        projections.open_store(tmp_path / "nothing")


def test_kernel_tiles_of_a_store_need_a_new_or_empty_folder(tmp_path):
    """`projections.distributed.kernel(path=...)` refuses a folder of other files (naming it,
    writing nothing) and an earlier kernel unless rewrite=True, as `ntk.distributed` does."""
    model, x = model_and_data()
    phi = store(tmp_path / "s", model, x)
    want = projections.kernel(phi, kind="trace")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a kernel")
    with pytest.raises(
        ValueError, match=re.escape(f"path {other} exists and is not an empty directory")
    ):
        projections.distributed.kernel(tmp_path / "s", path=other, tile=7)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match=re.escape(f"path {other} exists")):
        projections.distributed.kernel(tmp_path / "s", path=other, rewrite=True, tile=7)
    tiles = tmp_path / "tiles"
    projections.distributed.kernel(tmp_path / "s", path=tiles, tile=7)
    with pytest.raises(ValueError, match=re.escape(f"path {tiles} exists")):
        projections.distributed.kernel(tmp_path / "s", path=tiles, tile=7)
    projections.distributed.kernel(tmp_path / "s", path=tiles, rewrite=True, tile=5)
    np.testing.assert_allclose(ntk.distributed.load_tiles(tiles), want, rtol=1e-6, atol=1e-6)
    # back to 4 × 4 tiles of 7 samples: the folder holds exactly them (5 × 5 tiles of 5 before)
    (tiles / "tiles" / "notes.txt").write_text("not a tile")  # not the toolkit's: kept
    (tiles / "tiles" / "0_4.part.npz").write_bytes(b"")  # an interrupted writer's: removed
    projections.distributed.kernel(tmp_path / "s", path=tiles, rewrite=True, tile=7)
    np.testing.assert_allclose(ntk.distributed.load_tiles(tiles), want, rtol=1e-6, atol=1e-6)
    grid = [f"{i}_{j}.npz" for i in range(4) for j in range(i, 4)]
    assert sorted(p.name for p in (tiles / "tiles").iterdir()) == sorted([*grid, "notes.txt"])


def test_featurize_takes_a_kind_object(tmp_path):
    """kind= may be a Kind object, as in `projections.features`: the manifest records its name
    (it failed with "Object of type Trace is not JSON serializable"), so a resume by name
    matches."""
    from ntk.core import kinds

    torch.manual_seed(0)
    model = MLP().double().eval()
    x = torch.randn(5, 5, dtype=torch.float64)
    phi = projections.featurize(model, x, tmp_path / "s", dim=4, kind=kinds.get("sum_logits"))
    assert projections.store_info(tmp_path / "s")["kind"] == "sum_logits"
    again = projections.featurize(model, x, tmp_path / "s", dim=4, kind="sum_logits")
    np.testing.assert_array_equal(np.asarray(phi), np.asarray(again))
    np.testing.assert_allclose(
        np.asarray(phi), projections.features(model, x, dim=4, kind="sum_logits"), rtol=1e-6
    )


def test_featurize_takes_torchs_dtypes_and_names_store_dtype_it_cannot_store(tmp_path):
    """store_dtype=torch.float32 failed inside numpy ("Cannot interpret 'torch.float32' as a
    data type"), then was refused with "must be float16, float32 or float64, got torch.float16";
    torch's dtypes name numpy's, and a dtype no store holds is refused naming store_dtype."""
    model, x = MLP(), torch.randn(4, 5)
    ours = projections.featurize(model, x, tmp_path / "a", dim=4, store_dtype=torch.float16)
    theirs = projections.featurize(model, x, tmp_path / "b", dim=4, store_dtype="float16")
    assert ours.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    with pytest.raises(ValueError, match="store_dtype must be float16, float32 or float64"):
        projections.featurize(MLP(), x, tmp_path / "c", dim=4, store_dtype=torch.bfloat16)


def test_a_bfloat16_model_is_featurized_into_its_store(tmp_path):
    """A bfloat16 model's features failed on their way to the store with numpy's "Got
    unsupported ScalarType BFloat16"; float32 holds every bfloat16 value, so the store holds
    exactly the features `projections.features` gives."""
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16).eval()
    x = torch.randn(6, 5).to(torch.bfloat16)
    stored = projections.featurize(model, x, tmp_path / "s", dim=8, kind="sum_logits")
    direct = projections.features(model, x, dim=8, kind="sum_logits")
    assert direct.dtype == torch.bfloat16
    np.testing.assert_array_equal(np.asarray(stored), direct.float().numpy())


def test_the_kernel_of_a_float16_store_is_float32(tmp_path):
    """The kernel of a float16 store was computed in float16: past 65504 it overflowed and was
    refused as "not finite … the model's gradients on those samples", and below it came back
    with 3e-4 of relative error."""
    torch.manual_seed(0)
    x = torch.randn(6, 20) * 80
    phi = projections.featurize(
        torch.nn.Linear(20, 3), x, tmp_path / "s", dim=512, kind="sum_logits", store_dtype="float16"
    )
    k = projections.kernel(phi, kind="sum_logits")
    wide = projections.kernel(np.asarray(phi, dtype=np.float64), kind="sum_logits")
    assert k.dtype == np.float32 and np.abs(wide).max() > 65504
    np.testing.assert_allclose(k, wide, rtol=1e-6)


def test_features_below_float16s_range_are_refused_not_flushed_to_zero(tmp_path):
    """Features of scale 1e-7 were stored in float16 as 99 % zeros (the kernel 88 % off) without
    a word; overflow alone was refused. The same store in float32 keeps them."""
    model, x = model_and_data()
    tiny = {"output_fn": lambda out: out * 1e-7}
    with pytest.raises(ValueError, match=r"block 0 .* lose 0\.\d+ of their norm in store_dtype"):
        store(tmp_path / "half", model, x, store_dtype="float16", **tiny)
    assert projections.store_info(tmp_path / "half")["blocks"] == {}
    kept = store(tmp_path / "single", model, x, store_dtype="float32", **tiny)
    unit = store(tmp_path / "unit", model, x) * 1e-7  # int8 products round relative to a row
    np.testing.assert_allclose(kept, unit, rtol=1e-4, atol=1e-5 * np.abs(unit).max())


def test_one_sample_below_float16s_range_is_refused_among_larger_ones(tmp_path):
    """The cast's loss was measured over a whole batch, so one sample of scale 1e-7 among samples
    of scale 1 was flushed to zeros (its kernel row lost) without a word; it is now measured per
    sample and the refusal names the sample."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 3, bias=False).eval()  # features scale with the inputs
    x = torch.randn(6, 20)
    x[3] *= 1e-7
    opts = dict(dim=32, kind="sum_logits")
    with pytest.raises(ValueError, match=r"block 0 .* lose 0\.\d+ of their norm .*\(sample 3\)"):
        projections.featurize(model, x, tmp_path / "half", store_dtype="float16", **opts)
    assert projections.store_info(tmp_path / "half")["blocks"] == {}
    kept = np.asarray(projections.featurize(model, x, tmp_path / "single", **opts))
    assert 0 < np.abs(kept[3]).max() < 1e-5 < np.abs(kept[2]).max()


def test_featurize_casts_numpy_float64_data_to_the_models_dtype(tmp_path):
    """numpy's default float64 data for a float32 model failed in its first layer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = np.random.default_rng(0).standard_normal((6, 3))
    projections.featurize(model.eval(), x, tmp_path / "a", dim=8)
    projections.featurize(model, torch.from_numpy(x).float(), tmp_path / "b", dim=8)
    a, b = (np.asarray(projections.open_store(tmp_path / s)) for s in "ab")
    np.testing.assert_array_equal(a, b)


def test_featurize_casts_numpy_batches_of_a_loader_and_names_float64_tensor_batches(tmp_path):
    """A DataLoader whose collate_fn yields numpy float64 arrays was refused ("inputs must be a
    tensor ..., got ndarray"), and so were the float64 tensors the default collate makes of
    numpy samples; both are cast as direct numpy data is. Float64 tensor batches
    (a TensorDataset built from numpy) get the refusal naming the dtypes, as a float64 tensor."""
    from ntk.core.model import ModelInputError

    model, x = model_and_data()
    ref = store(tmp_path / "tensor", model, x)
    rows = x.double().numpy()
    loader = DataLoader(rows, batch_size=3, collate_fn=np.stack)
    assert np.array_equal(store(tmp_path / "numpy", model, loader), ref)
    # the default collate turns numpy samples into float64 tensors: they were refused as
    # float64 tensors ("numpy arrays are cast to it for you"), alone or first of a pair
    collated = DataLoader(rows, batch_size=3)
    assert np.array_equal(store(tmp_path / "collated", model, collated), ref)
    pairs = DataLoader(list(zip(rows, np.arange(len(rows)))), batch_size=4)
    assert np.array_equal(store(tmp_path / "pairs", model, pairs), ref)
    with pytest.raises(ValueError, match=r"yields single samples \(batch_size=None\)"):
        store(tmp_path / "samples", model, DataLoader(x, batch_size=None))  # read as batches
    assert not (tmp_path / "samples").exists()
    wide = DataLoader(TensorDataset(torch.from_numpy(rows)), batch_size=3)
    with pytest.raises(ModelInputError, match=r"^data: .*torch.float64.*cast the inputs to"):
        store(tmp_path / "float64", model, wide)


def test_featurize_never_writes_among_or_over_other_files(tmp_path):
    """featurize (Python) wrote a store into a directory of other files, and replaced a user's
    own features.npy there, taken for a killed writer's (the command line refused the first
    case only). A writer takes its lock first: without the lock, every entry is another's."""
    model, x = model_and_data()
    mine = tmp_path / "mine"
    mine.mkdir()
    np.save(mine / "features.npy", np.arange(10.0))
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(
        projections.StoreError, match=r"directory of other files \(features.npy, notes"
    ):
        store(mine, model, x)
    lone = tmp_path / "lone"
    lone.mkdir()
    np.save(lone / "features.npy", np.arange(10.0))
    assert projections.store.foreign_files(lone) == ["features.npy"]
    with pytest.raises(projections.StoreError, match="directory of other files"):
        store(lone, model, x)
    np.testing.assert_array_equal(np.load(lone / "features.npy"), np.arange(10.0))
    # a writer killed after taking its lock and writing its array: resumed, not refused
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "lock").write_text("")
    np.save(killed / "features.npy", np.zeros(3))
    assert projections.store.foreign_files(killed) == []
