"""Reading files from disk for the benchmarks' references: the page cache emptied of them, a plain read."""

from __future__ import annotations

import os
import time

from eagle3data.contracts.reading import READ_CHUNK


def drop_from_page_cache(paths: list[str]) -> None:
    """Write back everything, then evict these files' pages: the next read comes from disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: list[str]) -> float:
    """Seconds to read the files into one reused buffer: the reference for validate."""
    buffer = memoryview(bytearray(READ_CHUNK))  # the chunk load_states reads with
    began = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - began
