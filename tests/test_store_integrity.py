"""Integrity of feature stores: the data are part of what a store is (a resume with other data is
refused by block), the manifest is checked rather than believed, NaN never completes a block, one
writer at a time (a dead writer's lock is recovered), a complete store is only read, and a
property test of random featurize / kill / edit / truncate / resume sequences."""

import builtins
import json
import os
import random
import signal
import subprocess
import sys
import time

import dying
import numpy as np
import pytest
import torch
from disks import skip_as_root
from dying import BLOCK, N
from test_projections_store import run_dying

import projections

HERE = os.path.dirname(__file__)


class SqrtNet(torch.nn.Module):
    """Finite outputs, NaN gradients where W x = 0 (d√|y|/dy at y = 0 times sign(0))."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 4, bias=False)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.sqrt(self.fc(x).abs()))


def test_resume_with_other_data_is_refused_naming_the_first_differing_block(tmp_path):
    path = tmp_path / "s"
    run = run_dying(path, 7, 0, "records", 4)  # blocks 0-3 complete, block 4 missing
    assert run.returncode == 3, run.stderr
    other = dying.data()
    other[2 * BLOCK + 1] += 1.0  # same N, block 2 differs
    before = (path / "features.npy").read_bytes()
    with pytest.raises(projections.StoreError, match="first in block 2 "):
        projections.featurize(
            dying.model(), other, path, dim=dying.DIM, block=BLOCK, seed=1, batch_size=2
        )
    assert (path / "features.npy").read_bytes() == before  # nothing written for the new data
    assert np.array_equal(dying.featurize(path), dying.featurize(tmp_path / "fresh"))


def test_complete_store_refuses_other_data_of_the_same_size(tmp_path):
    dying.featurize(tmp_path / "s")
    with pytest.raises(projections.StoreError, match="first in block 0 "):
        dying.featurize(tmp_path / "s", data_seed=8)


def test_new_blocks_are_recorded_only_after_the_complete_ones_match(tmp_path):
    """Blocks 0-2 missing, 3-4 complete: other data are refused at block 3 and none of the
    blocks computed on the way is recorded, so the store never mixes two data sets."""
    path = tmp_path / "s"
    dying.featurize(path)
    manifest = json.loads((path / "manifest.json").read_text())
    for i in ("0", "1", "2"):
        del manifest["blocks"][i]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(projections.StoreError, match="first in block 3 "):
        dying.featurize(path, data_seed=8)
    assert sorted(projections.store_info(path)["blocks"]) == ["3", "4"]


def edit(path, key, change):
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    manifest[key] = change(manifest[key])
    file.write_text(json.dumps(manifest))


EDITS = [  # (manifest field, its edit, the refusal)
    ("dim", lambda v: v // 2, "shape is"),
    ("samples", lambda v: v - 3, "shape is"),
    ("seed", lambda v: v + 1, "checksum"),
    ("num_blocks", lambda v: v - 1, "num_blocks is 4"),
    ("batch", lambda v: v + 1, "checksum"),
    ("block", lambda v: v + 1, "num_blocks is 5"),
    ("kind", lambda v: "sum_logits", "shape is"),
    ("shape", lambda v: [v[0], v[1], v[2] // 2], "shape is"),
    ("store_dtype", lambda v: "float64", "checksum"),
    ("projector", lambda v: "gaussian", "checksum"),
    ("model", lambda v: "0" * 64, "checksum"),
    ("dim", lambda v: True, "not a JSON int"),
    ("blocks", lambda v: {**v, "7": v["0"]}, "block '7'"),
    ("blocks", lambda v: {**v, "0": {"features": "x"}}, "block 0 is"),
    ("format", lambda v: "ntk-feature-store/1", "another version"),
    ("num_outputs", lambda v: v + 1, "shape is"),
    ("compute_dtype", lambda v: "float64", "checksum"),
    ("settings_sha256", lambda v: "0" * 64, "checksum"),
]


@pytest.mark.parametrize("key, change, message", EDITS)
def test_edited_manifest_is_refused(tmp_path, key, change, message):
    path = tmp_path / "s"
    dying.featurize(path)
    edit(path, key, change)
    with pytest.raises(projections.StoreError, match=message):
        projections.open_store(path)
    with pytest.raises(projections.StoreError, match=message):
        dying.featurize(path)


def test_every_manifest_field_is_edited_above(tmp_path):
    dying.featurize(tmp_path / "s")
    assert {key for key, _, _ in EDITS} == set(projections.store_info(tmp_path / "s"))


def test_manifest_shape_must_match_the_array_header(tmp_path):
    path = tmp_path / "s"
    dying.featurize(path)
    np.save(path / "features.npy", np.zeros((N, 3, dying.DIM), dtype="float64"))
    with pytest.raises(projections.StoreError, match="holds float64"):
        projections.open_store(path)
    np.save(path / "features.npy", np.zeros((N - 3, 3, dying.DIM), dtype="float32"))
    with pytest.raises(
        projections.StoreError, match=rf"holds float32 \[{N - 3}, 3, {dying.DIM}\], the manifest"
    ):
        projections.open_store(path)


def test_block_with_nan_gradients_is_never_marked_complete(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(12, 5)
    x[7] = 0.0  # block 1 of blocks of 4
    with pytest.raises(ValueError, match="not finite"):
        projections.featurize(SqrtNet().eval(), x, tmp_path / "s", dim=8, block=4, batch_size=2)
    assert sorted(projections.store_info(tmp_path / "s")["blocks"]) == ["0"]
    with pytest.raises(projections.StoreError, match="incomplete"):
        projections.open_store(tmp_path / "s")


@pytest.fixture
def no_writes(monkeypatch):
    """Refuse, within the test, every attempt to open a file for writing."""
    real_open, real_os_open, real_memmap = builtins.open, os.open, np.memmap.__new__
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise PermissionError(f"opened {file} for writing ({mode})")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(file, flags, *args, **kwargs):
        if flags & writing:
            raise PermissionError(f"opened {file} for writing")
        return real_os_open(file, flags, *args, **kwargs)

    def guarded_memmap(cls, filename, dtype=np.uint8, mode="r+", *args, **kwargs):
        if mode not in ("r", "c"):
            raise PermissionError(f"memory-mapped {filename} for writing ({mode})")
        return real_memmap(cls, filename, dtype, mode, *args, **kwargs)

    def guard():
        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(os, "open", guarded_os_open)
        monkeypatch.setattr(np.memmap, "__new__", guarded_memmap)

    return guard


def test_featurize_on_a_complete_store_opens_nothing_for_writing(tmp_path, no_writes):
    path = tmp_path / "s"
    want = np.array(dying.featurize(path))
    no_writes()
    assert np.array_equal(dying.featurize(path), want)
    with pytest.raises(PermissionError):  # the guard works: an incomplete store must write
        dying.featurize(tmp_path / "other")


@skip_as_root
def test_complete_store_in_a_read_only_directory_is_read(tmp_path):
    path = tmp_path / "s"
    want = np.array(dying.featurize(path))
    for f in path.iterdir():
        f.chmod(0o444)
    path.chmod(0o555)
    try:
        assert np.array_equal(dying.featurize(path), want)
    finally:
        path.chmod(0o755)


@skip_as_root
@pytest.mark.parametrize("mode, purpose", [(0o444, "writing"), (0o200, "reading")])
def test_an_array_that_may_not_be_opened_is_refused_as_such_not_as_damaged(tmp_path, mode, purpose):
    """Resuming a store whose features.npy lost its write (or read) permission was refused as
    "cannot read …/features.npy (truncated or damaged?): [Errno 13] Permission denied"."""
    path = tmp_path / "s"
    run = run_dying(path, 7, 0, "records", 2)  # blocks 0-1 complete
    assert run.returncode == 3, run.stderr
    array = path / "features.npy"
    array.chmod(mode)
    with pytest.raises(projections.StoreError) as refused:
        dying.featurize(path)
    assert str(refused.value) == f"cannot open {array} for {purpose}: Permission denied"
    array.chmod(0o644)
    assert np.array_equal(dying.featurize(path), dying.featurize(tmp_path / "whole"))


HOLD = """
import sys, time
from pathlib import Path
from projections import _format
with _format.writer_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "s"
    run_dying(path, 7, 0, "records", 1)  # an incomplete store
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(projections.StoreError, match=f"process {holder.pid} on "):
            dying.featurize(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert np.array_equal(dying.featurize(path), dying.featurize(tmp_path / "fresh"))


def test_lock_of_a_dead_writer_is_recovered(tmp_path):
    path = tmp_path / "s"
    run = run_dying(path, 7, 0, "forward", 12)  # dies inside a block, holding the lock
    assert run.returncode == 3, run.stderr
    holder = json.loads((path / "lock").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(holder["pid"], 0)
    assert np.array_equal(dying.featurize(path), dying.featurize(tmp_path / "fresh"))


def test_concurrent_writers_leave_one_store_and_a_clear_error(tmp_path):
    """Two processes start on one store: each either completes it or is refused with the
    lock's StoreError (never a raw OSError), and the store equals a fresh one."""
    path = tmp_path / "s"
    runs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dying.py"), str(path), "7", "0", "forward", "999"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outcomes = [(r.wait(timeout=300), r.stderr.read()) for r in runs]
    for code, err in outcomes:
        assert code == 0 or (code == 1 and err.startswith("StoreError: ")), err
    if any(code for code, _ in outcomes):
        assert any("being written by process" in err for _, err in outcomes)
    assert np.array_equal(dying.featurize(path), dying.featurize(tmp_path / "fresh"))


def test_distributed_without_a_process_group_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="distributed=True needs an initialised"):
        projections.featurize(dying.model(), dying.data(), tmp_path / "s", dim=4, distributed=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        projections.featurize(dying.model(), dying.data(), tmp_path / "s", dim=4)
    assert not (tmp_path / "s").exists()


def test_distributed_with_a_group_of_one_process_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="more than one process \\(this one has 1\\)"):
            projections.featurize(
                dying.model(), dying.data(), tmp_path / "s", dim=4, distributed=True
            )
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "s").exists()


# -- the property test ---------------------------------------------------------------------------

STEPS = {  # step: weight (kills run a subprocess and are the slow ones)
    "featurize": 3,
    "kill": 1,
    "interrupt": 2,
    "edit": 1,
    "truncate": 1,
    "other data": 2,
    "other model": 1,
}


def _interrupt(path, data_seed, count):
    """featurize in this process, interrupted (KeyboardInterrupt, as Ctrl-C) when the model
    starts its `count`-th forward pass; a refusal is fine too."""
    net = dying.model()
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] >= count:
            raise KeyboardInterrupt

    net.register_forward_pre_hook(hook)
    try:
        dying.featurize(path, data_seed, net=net)
    except (KeyboardInterrupt, projections.StoreError):
        pass


def _edit_randomly(path, rng):
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    key = rng.choice(sorted(manifest))
    value = manifest[key]
    if key == "blocks":
        if value and rng.random() < 0.5:
            del value[rng.choice(sorted(value))]  # as if killed before recording it
        elif value:
            entry = value[rng.choice(sorted(value))]
            entry[rng.choice(["features", "inputs"])] = "0" * 64
        else:
            value["0"] = {"features": "1" * 64, "inputs": "2" * 64}
    elif isinstance(value, bool) or not isinstance(value, (int, str, list)):
        manifest[key] = None
    elif isinstance(value, int):
        manifest[key] = value + rng.choice([-1, 1, 7])
    elif isinstance(value, list):
        manifest[key] = value[:-1] + [value[-1] + 1]
    else:
        manifest[key] = value[:-1] + ("0" if value[-1] != "0" else "1")
    file.write_text(json.dumps(manifest))


@pytest.mark.slow
def test_random_store_histories_are_fresh_featurisations_or_refused(tmp_path):
    """Random sequences of featurize / kill (after a random block, or mid-block) / interrupt
    (KeyboardInterrupt at a random forward pass) / edit a random
    manifest field / truncate the array / resume with other data or another model: every result
    of featurize and open_store equals, bit for bit, a fresh single-process featurisation of the
    data and model it was asked for (or last completed with), or is a StoreError."""
    rng = random.Random(2024)
    fresh = {}

    def reference(data_seed, model_seed):
        key = (data_seed, model_seed)
        if key not in fresh:
            fresh[key] = np.array(dying.featurize(tmp_path / f"ref{key}", data_seed, model_seed))
        return fresh[key]

    started = time.perf_counter()
    histories = 0
    while histories < 12 and time.perf_counter() - started < 30:  # < 60 s in all
        histories += 1
        path = tmp_path / f"h{histories}"
        done = None  # (data, model) of the last featurize that returned
        for _ in range(rng.randint(3, 7)):
            step = rng.choices(list(STEPS), weights=list(STEPS.values()))[0]
            data_seed, model_seed = 7, 0
            if step == "other data":
                data_seed = rng.choice([8, 9])
            if step == "other model":
                model_seed = 1
            if step == "kill":
                how = rng.choice(["records", "forward"])
                count = rng.randint(1, 5) if how == "records" else rng.randint(1, 45)
                run = run_dying(path, rng.choice([7, 8]), 0, how, count)
                assert run.returncode in (0, 3) or run.stderr.startswith("StoreError: "), run.stderr
                done = None  # it may have completed the store, with either data
            elif step == "interrupt":
                _interrupt(path, rng.choice([7, 8]), rng.randint(1, 45))
                done = None
            elif step == "edit" and (path / "manifest.json").exists():
                _edit_randomly(path, rng)
            elif step == "truncate" and (path / "features.npy").exists():
                raw = (path / "features.npy").read_bytes()
                (path / "features.npy").write_bytes(raw[: rng.randrange(len(raw))])
            elif step in ("featurize", "other data", "other model"):
                try:
                    got = dying.featurize(path, data_seed, model_seed)
                except projections.StoreError:
                    continue
                assert np.asarray(got).tobytes() == reference(data_seed, model_seed).tobytes()
                done = (data_seed, model_seed)
            try:
                opened = projections.open_store(path)
            except projections.StoreError:
                continue
            candidates = [done] if done else [(d, m) for d in (7, 8, 9) for m in (0, 1)]
            assert any(
                np.asarray(opened).tobytes() == reference(*c).tobytes() for c in candidates
            ), (step, done)
    assert histories >= 3


def test_float16_store_refuses_features_that_overflow(tmp_path):
    """Features beyond float16's range were stored as inf in a store that looked complete; the
    cast is now checked and the block refused naming store_dtype."""
    model = torch.nn.Linear(3, 2).double().eval()
    x = torch.randn(4, 3, dtype=torch.float64) * 1e6
    with pytest.raises(ValueError, match="overflow store_dtype='float16'"):
        projections.featurize(model, x, tmp_path / "s", dim=5, store_dtype="float16")
    with pytest.raises(projections.StoreError, match="incomplete"):
        projections.open_store(tmp_path / "s")


@pytest.mark.parametrize("temporary", [None, "out.bin.1.tmp"])
def test_atomic_path_renames_a_complete_file_and_removes_a_failed_one(tmp_path, temporary):
    from ntk.core.files import atomic_path

    target = tmp_path / "out.bin"
    with atomic_path(target, temporary=temporary, durable=True) as tmp:
        tmp.write_bytes(b"first")
    assert target.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as a normally created file
    with (
        pytest.raises(RuntimeError, match="midway"),
        atomic_path(target, temporary=temporary) as tmp,
    ):
        tmp.write_bytes(b"par")
        raise RuntimeError("midway")
    assert target.read_bytes() == b"first"  # the earlier content is kept, no temporary left
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "new.bin") as tmp:
        tmp.write_bytes(b"par")
        raise RuntimeError("midway")
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]  # no file under the final name


def test_atomic_path_writes_through_a_symlink_and_keeps_the_permissions(tmp_path):
    """The rename replaced a symlink (an --output or a store's file linked elsewhere) by a
    regular file, leaving the file it named as it was, and gave a replaced file the permissions
    of a new one (a 0o600 result became world-readable)."""
    from ntk.core.files import atomic_path

    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "out.txt"
    real.write_text("old")
    real.chmod(0o600)
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    with atomic_path(link) as tmp:
        tmp.write_text("new")
    assert link.is_symlink() and real.read_text() == "new"
    assert real.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["link.txt", "out.txt", "real"]
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "real" / "made.txt")
    with atomic_path(dangling) as tmp:
        tmp.write_text("made")
    assert dangling.is_symlink() and (tmp_path / "real" / "made.txt").read_text() == "made"


def test_atomic_path_refuses_to_replace_a_device(tmp_path):
    """The rename replaced a device such as /dev/null (as root) with a regular file."""
    from ntk.core.files import atomic_path

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match="pipe is not a regular file"), atomic_path(pipe):
        pass
    assert pipe.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["pipe"]
