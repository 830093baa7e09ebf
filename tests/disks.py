"""Writes that fail as on a full disk, for the tests of outputs that cannot be written."""

import resource


def file_size_limit(size: int):
    """A subprocess's `preexec_fn` limiting the files it writes to `size` bytes: a write past
    the limit fails with EFBIG, "File too large" (Python ignores SIGXFSZ), as on a full disk."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

    return limit
