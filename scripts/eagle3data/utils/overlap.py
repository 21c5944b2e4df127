"""Overlap I/O with compute: produce an iterator's next item in a thread while the caller uses this one.

File reads and torch release the GIL (the CRC, ISA-L's, holds it ~1 us a row), so reading the next
block or batch runs beside measuring or writing the current one. At most two items are alive: the one the caller holds (it must
drop it before asking for the next) and the one being produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


def ahead(items: Iterator[T]) -> Iterator[T]:
    """`items` in order, each produced in a worker thread while the previous one is in use; an
    exception raised while producing an item is raised here, in its place."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3data-ahead") as pool:
        pending = pool.submit(next, items, _DONE)
        while (item := pending.result()) is not _DONE:
            pending = pool.submit(next, items, _DONE)
            yield item
