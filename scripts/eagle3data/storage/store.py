"""The per-sample hidden-states store: where each sample's file lives, and how files are written.

One safetensors file per sample, written by vLLM's worker (see `capture/connector.py`) in vLLM's hidden-states
format: `hidden_states [T, n_captures, H]` and `token_ids [T]`. Files live outside Snakemake's declared
outputs, under a key that changes whenever the model, the captures or the dtype change (the tokens are
compared file by file on reuse), so a failed or killed job never loses finished samples and a changed
config never reuses stale ones.

Every write in this project goes through `atomic_path`: write to a temporary name in the same directory,
fsync, rename, fsync the directory. A crash at any point leaves either the old file, no file, or a
`.*.tmp-<pid>` file that nothing reads as a result (the fault point `write:<path>` stops a test run right
there, utils/faults.py).

The states files are the exception to the fsyncs, not to the rename: an fsync per file inside vLLM's
writer threads held the extract stage to what the disk syncs file by file (measured: 8.6 GB in 512
files, 2.0 GB/s synced against 26 GB/s into the page cache; extract at 0.77 of bare prefill). They are
written with `durable=False`, which renames at once and has a background thread start the file's
writeback (`start_writeback`), and the extract job makes the whole shard durable once (`make_durable`),
before its manifest, the file that tells Snakemake the shard is done. A process crash (OOM, SLURM's kill, `kill -9`) still
never leaves a file that looks whole; after a power loss before that point, a renamed file may have lost
its data: ext4 and XFS then show it empty or short, the next run's header check finds it unreadable and
computes the sample again, and the shard was never marked done.

A run's stages reach its store through one `Store`, built once from the settings
(`Settings.store`): a sample's path, its dropped files given back, files dropped, the disk's room, the
files made durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eagle3data.storage import room
from eagle3data.utils.defaults import section_defaults
from eagle3data.utils.logs import get_logger
from eagle3data.utils import faults

logger = get_logger(__name__)

STATES_SUFFIX = ".safetensors"
PACKED = "packed"  # the store's directory of packed shards (dataset/packed.py)
UNLINK_THREADS = 16


@dataclass(frozen=True)
class Store:
    """One run's store of per-sample states files.

    `root` is the store's directory (`states/<key>`), the packed shards under it; `samples` is where each
    sample's file lives: the root, or a directory under storage.transport_dir. `restore` gives back, from
    the packed shards, the files of the samples asked for that are gone (its arguments: this store and
    those ids; it returns the ids restored): under storage.drop_packed_states only, None otherwise, where a
    gone file is damage for validate to report. It reads the packed format, a floor above this one, so
    the settings hand it in."""

    root: Path
    samples: Path
    reserve_gib: float
    check_free_space: bool
    restore: Callable[[Store, list[str]], list[str]] | None = None

    @classmethod
    def at(cls, root: str | os.PathLike, **storage) -> Store:
        """A store whose files live in `root` itself, under the schema's storage settings with `storage`
        over them, restoring nothing: for what is built by hand (tests, benchmarks)."""
        settings = section_defaults("storage", storage)
        return cls(Path(root), Path(root), settings["reserve_gib"], settings["check_free_space"])

    def path(self, sample_id: str) -> Path:
        return sample_path(self.samples, sample_id)

    @property
    def packed(self) -> Path:
        return self.root / PACKED

    def packed_shard(self, shard: str) -> Path:
        """Where shard `shard` (its five digits) is packed."""
        return self.packed / f"shard-{shard}.arrow"

    @property
    def drops(self) -> bool:
        """Whether a sample's file goes once a durable packed shard holds it (storage.drop_packed_states)."""
        return self.restore is not None

    def ensure(self, sample_ids: Iterable[str]) -> list[str]:
        """Give back the dropped files of these samples that a packed shard holds, before a job reads
        them; the ids restored. What no packed shard holds stays missing: computed or reported as before."""
        if self.restore is None:
            return []
        missing = [s for s in sample_ids if not self.path(s).exists()]
        return self.restore(self, missing) if missing else []

    def drop(self, sample_ids: Iterable[str]) -> int:
        """Delete the files of samples that a durable packed shard now holds; how many there were.
        Several at once: on a GPU node, one unlink of a just-written 16 MB file took ~10 ms, 7 s a shard."""
        def drop(sample_id: str) -> bool:
            try:
                self.path(sample_id).unlink()
            except FileNotFoundError:
                return False
            return True

        with ThreadPoolExecutor(UNLINK_THREADS, thread_name_prefix="eagle3data-drop") as pool:
            return sum(pool.map(drop, sample_ids))

    def check_room(self, nbytes: int, where: str | os.PathLike | None = None, what: str = "the states store") -> None:
        """Refuse to start (storage.check_free_space; else warn) when the disk of `where` (the store by
        default) lacks `nbytes` and storage.reserve_gib."""
        where = self.root if where is None else where
        room.check_free_space(where, nbytes, self.reserve_gib, self.check_free_space, what)

    def check_room_for_samples(self, store_bytes: int, sample_bytes: int) -> None:
        """Room for `store_bytes` in the store, and where a transport directory holds the sample files,
        room there for this job's `sample_bytes` (they leave it once packed)."""
        self.check_room(store_bytes)
        if self.samples != self.root:
            self.check_room(sample_bytes, self.samples, "the transport (storage.transport_dir)")

    def make_durable(self, paths: list[Path], synced: set[Path] = frozenset()) -> None:
        """What the engine's writers left to do for these files (`make_durable`), done once."""
        make_durable(paths, synced)


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike, durable: bool = True) -> Iterator[str]:
    """Yield a temporary path beside `final_path`; rename it into place only if the block succeeds.
    `durable=False`: start the file's writeback but do not wait for it (the caller runs `make_durable`)."""
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}")
    try:
        yield str(tmp)
        faults.point(f"write:{final_path}")
        if durable and tmp.is_file():
            _fsync_file(tmp)
        os.replace(tmp, final_path)
        if durable:
            _fsync_dir(final_path.parent)
        else:
            start_writeback(final_path)
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


def start_writeback(path: Path) -> None:
    """Have the kernel start writing the file to disk now (Linux's sync_file_range WRITE), from one
    background thread: that call blocks while the disk's queue is full, and vLLM's writer threads must
    not (measured: they then fell 1 s behind the GPU). The disk works while the GPU computes, and
    `make_durable` finds little left. A no-op where the call does not exist: `make_durable` does it all."""
    if _sync_file_range is not None:
        _writeback.submit(_write_back, path)


def _write_back(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # removed since: a failed sample
        return
    try:
        if _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:  # make_durable's fsync will tell
            logger.warning("sync_file_range(%s): %s", path, os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


def make_durable(paths: list[Path], synced: set[Path] = frozenset(), threads: int = 8) -> None:
    """fsync these files (but those in `synced`: `start_syncing` did them), then their directories (their
    renames), `threads` at a time: what `atomic_path(..., durable=False)` left to do, done once."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(_fsync_file, [p for p in paths if Path(p) not in synced]))
        list(pool.map(_fsync_dir, sorted({Path(p).parent for p in paths})))


def start_syncing(paths: list[Path], threads: int = 8) -> Future:
    """Start fsyncing these files in the background, e.g. while the last ones are still being written;
    the result: the set of those synced (a file removed meanwhile is skipped). Directories are left to
    `make_durable`, once every rename is done."""

    def sync(path: Path) -> Path | None:
        try:
            _fsync_file(path)
        except FileNotFoundError:
            return None
        return Path(path)

    def sync_all() -> set[Path]:
        with ThreadPoolExecutor(threads) as pool:
            return {p for p in pool.map(sync, paths) if p is not None}

    return _syncing.submit(sync_all)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _load_sync_file_range():
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>
_sync_file_range = _load_sync_file_range()
_writeback = ThreadPoolExecutor(1, thread_name_prefix="eagle3data-writeback")
_syncing = ThreadPoolExecutor(1, thread_name_prefix="eagle3data-sync")


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
