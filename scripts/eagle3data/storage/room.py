"""Whether a disk has room for what a job is about to write: asked before anything is written, so a
full disk stops a job at its start, not halfway through a file. Here, on the storage floor, because the
store (store.py) checks its own disk; plan/disk.py estimates the bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle3data.utils.logs import get_logger

logger = get_logger(__name__)
GIB = 1024**3


class DiskSpaceError(RuntimeError):
    pass


def check_free_space(directory: str | Path, needed_bytes: int, reserve_gib: float, enforce: bool,
                     what: str = "the states store") -> None:
    """Refuse (or, with enforce False, warn) when the disk of `directory` (`what` writes there) has less
    than needed + reserve free."""
    path = Path(directory)
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    required = needed_bytes + round(reserve_gib * GIB)
    if free >= required:
        logger.info("disk: %s free at %s, %s needed (reserve included)", gib(free), path, gib(required))
        return
    message = (
        f"disk: {what} {directory} (on the filesystem of {path}) needs {gib(required)} "
        f"({gib(needed_bytes)} still to write + {reserve_gib} GiB reserve), found {gib(free)} free"
    )
    if enforce:
        raise DiskSpaceError(
            f"{message}. Free space, put results/ on a larger disk, or set storage.check_free_space: "
            "false to start anyway."
        )
    logger.warning("%s; starting anyway (storage.check_free_space is false)", message)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
