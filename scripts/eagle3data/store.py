"""The per-sample hidden-states store: where each sample's file lives, and how files are written.

One safetensors file per sample, written by vLLM's worker (see `connector.py`) in vLLM's hidden-states
format: `hidden_states [T, n_captures, H]` and `token_ids [T]`. Files live outside Snakemake's declared
outputs, under a key that changes whenever the model, the captures or the dtype change (the tokens are
compared file by file on reuse), so a failed or killed job never loses finished samples and a changed
config never reuses stale ones.

Every write in this project goes through `atomic_path`: write to a temporary name in the same directory,
fsync, rename, fsync the directory. A crash at any point leaves either the old file, no file, or a
`.*.tmp-<pid>` file that nothing reads as a result (`testing.kill_point` stops a test run right there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from eagle3data.testing import kill_point

STATES_SUFFIX = ".safetensors"


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside `final_path`; rename it into place only if the block succeeds."""
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}")
    try:
        yield str(tmp)
        kill_point(f"write:{final_path}")
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final_path)
        _fsync_dir(final_path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            if tmp.is_dir():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
        raise


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a power loss after it must not bring back the old name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)


def content_key(**determinants) -> str:
    """A short stable hash of everything that determines the extracted data."""
    blob = json.dumps(determinants, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def sample_path(store_dir: str | os.PathLike, sample_id: str) -> Path:
    """Where the states of `sample_id` live: fanned out by the id's first two characters."""
    return Path(store_dir) / sample_id[:2] / f"{sample_id}{STATES_SUFFIX}"
