"""Small files read whole (configs, indexes, manifests) and what a file that is not a regular one is.

A path a user or a manifest names may be a named pipe, a device or a huge file: reading it would wait
for a writer forever or fill memory. These reads open without blocking, check the kind and size, then
read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SMALL_FILE_LIMIT = 64 << 20  # a JSON file mergedb reads whole (configs, indexes, manifests): far above any real one


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return kind
    return "not a regular file"


def link_roots(folder: str | os.PathLike[str]) -> list[Path]:
    """Where a checkpoint's files (shards, config, side files) may lead through symlinks: inside
    `folder`, and for a Hugging Face cache snapshot (`.../models--ORG--NAME/snapshots/REV`, whose
    files link to ../../blobs/SHA) into its own repository's blobs/ folder; never anywhere else."""
    real = Path(folder).resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def leads_inside(path: str | os.PathLike[str], roots: list[Path]) -> bool:
    """Whether `path`, its links followed, is inside one of `roots` (link_roots); a dangling or
    looping link is not."""
    try:
        target = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, dangling, a loop (RuntimeError before Python 3.13)
        return False
    return any(target.is_relative_to(r) for r in roots)


def read_small(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a small regular file (a config, an index, a manifest), whole. A named pipe, a
    device (config.json -> /dev/zero) or a file over SMALL_FILE_LIMIT raises OSError (EINVAL, EFBIG)
    at once, where reading it would wait forever or fill memory; callers treat it as unreadable."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"it is {file_kind(st.st_mode)}, not a regular file", str(path))
        if st.st_size > SMALL_FILE_LIMIT:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than a file of its kind holds", str(path))
        data = read_exact(fd, SMALL_FILE_LIMIT + 1, 0)
        if len(data) > SMALL_FILE_LIMIT:  # it grew while read
            raise OSError(errno.EFBIG, "more bytes than a file of its kind holds", str(path))
        return data
    finally:
        os.close(fd)


def read_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes of `fd` from `offset` (fewer only at the end of the file)."""
    chunks, done = [], 0
    while done < n:
        b = os.pread(fd, n - done, offset + done)
        if not b:
            break
        chunks.append(b)
        done += len(b)
    return b"".join(chunks)
