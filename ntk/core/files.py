"""Files written atomically: the content is written to a temporary file in the target's folder and
renamed onto the final name only once complete, so a partial file never carries that name."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _new_temporary(target: Path) -> Path:
    """An empty file ``.<name>.<random>.part`` next to `target`, created with the permissions of
    a normal new file (0o666 less the umask)."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.part"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name for {target}")


@contextmanager
def writes_to(path, temporary=None) -> Iterator[None]:
    """Around writes to the file `path` (through `temporary`, if given): an OSError that names no
    file (a write's own, on a full disk or past the file size limit) or the temporary is raised
    again naming `path`, so that the caller can tell which output failed ("[Errno 28] No space
    left on device: 'store/manifest.json'")."""
    try:
        yield
    except OSError as exc:
        if exc.errno is not None and exc.filename in (None, str(temporary)):
            exc.filename = str(path)
        raise


def directory_path(path, holds: str) -> Path:
    """`path` as the Path of a directory that `holds` something (a feature store, kernel tiles),
    which may not exist yet: anything but a str or os.PathLike is a TypeError, an existing file a
    ValueError, each naming what the directory holds."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a str or os.PathLike naming {holds}, got {type(path).__name__}"
        )
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"path {root} is a file, not the directory of {holds}")
    return root


def check_replaceable(target, name: str | None = None) -> None:
    """Refuse an existing `target` that is not a regular file (a device such as /dev/null, a
    pipe): `atomic_path`'s rename would replace it. `name`: the argument or flag that gave it."""
    target = Path(target)
    if target.exists() and not target.is_file():
        where = "" if name is None else f"{name}: "
        raise ValueError(
            f"{where}{target} is not a regular file; the output replaces it by a rename"
        )


def written_path(target) -> Path:
    """The file that a write to `target` replaces: the file a symlink names (written through it,
    the link kept), else `target` itself."""
    target = Path(target)
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def make_directory(path) -> None:
    """mkdir -p `path`, also where it or a folder above it is a symlink to a folder not made
    yet: the folder the links name is made and the links kept, as every write goes through a
    link (`written_path`); Path.mkdir refuses a dangling link itself ("File exists")."""
    Path(os.path.realpath(path)).mkdir(parents=True, exist_ok=True)


@contextmanager
def atomic_path(target, *, temporary: str | None = None, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path in `target`'s folder to write; on normal exit (fsync'ed first if
    `durable`) it is renamed onto `target`, on any exception it is removed and the exception
    re-raised, so a failure leaves an earlier file of that name as it was.

    `temporary`: the temporary's file name (the caller creates the file), for writers whose
    leftovers are recognised by name; by default a fresh ``.<name>.<random>.part`` (created
    empty, with the permissions of a normal new file). An existing `target` that is not a
    regular file (a device such as /dev/null, a pipe) is refused: the rename would replace it.
    As writing in place would, a symlink is written through (the file it names is replaced, the
    link kept) and an existing file keeps its permission bits. A failed write names `target`
    (`writes_to`)."""
    target = written_path(target)
    check_replaceable(target)
    tmp = _new_temporary(target) if temporary is None else target.parent / temporary
    try:
        with writes_to(target, tmp):
            yield tmp
            if durable:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if target.exists():
                os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
            os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
