"""What a run measures of its own process: peak memory and the bytes it really read from storage."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: on Linux a child started by fork and
    exec inherits its parent's high-water mark there, so a small merge run from a big process
    would report the parent's memory."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def physical_read_bytes() -> int:
    """Bytes this process has fetched from storage so far (/proc/self/io read_bytes; page-cache
    hits are not counted). 0 where the kernel does not report it."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
