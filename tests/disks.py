"""Writes that fail as on a full disk or for a file's permission, for the tests of outputs that
cannot be written."""

import os
import resource
import tempfile

import pytest


def _permission_binds() -> bool:
    """Whether a file's permission bits bind this process: root (CAP_DAC_OVERRIDE) writes into
    read-only files and directories."""
    with tempfile.TemporaryDirectory() as folder:
        probe = os.path.join(folder, "probe")
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o444))
        try:
            os.close(os.open(probe, os.O_WRONLY))
        except PermissionError:
            return True
        return False


# for the tests of a permission that chmod took away
skip_as_root = pytest.mark.skipif(
    not _permission_binds(), reason="root writes into read-only files and directories"
)


def file_size_limit(size: int):
    """A subprocess's `preexec_fn` limiting the files it writes to `size` bytes: a write past
    the limit fails with EFBIG, "File too large" (Python ignores SIGXFSZ), as on a full disk."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

    return limit
